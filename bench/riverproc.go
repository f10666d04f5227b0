package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/shardrun/shardrun/internal/linewriter"
)

// riverChildFlag, as the first argument, makes the bench binary a River
// worker process (riverChild) instead of the bench. River runs in processes
// of its own, as shardrun's runners do, so that the CPU it spends can be read
// apart from the bench's (which polls, inserts and runs etcd).
const riverChildFlag = "-river-child"

// newRiverClient is a River client on pool with the bench's settings; with
// work it runs the noop and sleep jobs of the default queue, without it
// only inserts (an insert-only client must not configure queues).
func newRiverClient(pool *pgxpool.Pool, rs riverSettings, work bool) (*river.Client[pgxTx], error) {
	cooldown, err := time.ParseDuration(rs.FetchCooldown)
	if err != nil {
		return nil, fmt.Errorf("river fetch cooldown: %w", err)
	}
	poll, err := time.ParseDuration(rs.FetchPollInterval)
	if err != nil {
		return nil, fmt.Errorf("river fetch poll interval: %w", err)
	}
	cfg := &river.Config{FetchCooldown: cooldown, FetchPollInterval: poll, Logger: discardLogger()}
	if work {
		workers := river.NewWorkers()
		river.AddWorker(workers, &NoopWorker{})
		river.AddWorker(workers, &SleepWorker{})
		cfg.Workers = workers
		cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: rs.MaxWorkers}}
	}
	return river.NewClient(riverpgxv5.New(pool), cfg)
}

// riverPool is a pool on dsn of at most conns connections.
func riverPool(ctx context.Context, dsn string, conns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("river pool config: %w", err)
	}
	cfg.MaxConns = conns
	return pgxpool.NewWithConfig(ctx, cfg)
}

// riverChild is the child mode: one River client working noop and sleep
// jobs until SIGTERM, then a graceful stop. It prints "ready" once the
// client started.
func riverChild(args []string) int {
	fs := flag.NewFlagSet("river-child", flag.ExitOnError)
	dsn := fs.String("dsn", "", "database")
	var rs riverSettings
	fs.IntVar(&rs.MaxWorkers, "max-workers", 1000, "MaxWorkers of the default queue")
	fs.StringVar(&rs.FetchCooldown, "fetch-cooldown", "2ms", "FetchCooldown")
	fs.StringVar(&rs.FetchPollInterval, "fetch-poll-interval", "20ms", "FetchPollInterval")
	conns := fs.Int("pool-conns", 16, "pool size")
	_ = fs.Parse(args)
	rs.PoolConns = int32(*conns)
	if err := runRiverChild(*dsn, rs); err != nil {
		fmt.Fprintln(os.Stderr, "river child:", err)
		return 1
	}
	return 0
}

func runRiverChild(dsn string, rs riverSettings) error {
	sig, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	ctx := context.Background()
	pool, err := riverPool(ctx, dsn, rs.PoolConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	client, err := newRiverClient(pool, rs, true)
	if err != nil {
		return err
	}
	// Not sig: cancelling Start's context stops the client without waiting
	// for running jobs; the graceful Stop below is what a deployment does.
	if err := client.Start(ctx); err != nil {
		return fmt.Errorf("starting river client: %w", err)
	}
	fmt.Println("ready")
	<-sig.Done()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := client.Stop(sctx); err != nil {
		return fmt.Errorf("stopping river client: %w", err)
	}
	return nil
}

// riverProc is one River child process, as runnerProc is one runner.
type riverProc struct {
	cmd  *exec.Cmd
	logs *linewriter.Buffer
	done chan error
}

// startRiverProc starts a River child process on dsn and returns once its
// client started.
func startRiverProc(dsn string, rs riverSettings) (*riverProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding the bench binary to run River in: %w", err)
	}
	p := &riverProc{logs: &linewriter.Buffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(self, riverChildFlag, "-dsn", dsn, "-max-workers", strconv.Itoa(rs.MaxWorkers),
		"-fetch-cooldown", rs.FetchCooldown, "-fetch-poll-interval", rs.FetchPollInterval,
		"-pool-conns", strconv.Itoa(int(rs.PoolConns)))
	p.cmd.Stderr = p.logs
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting river child: %w", err)
	}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if sc.Text() == "ready" {
				close(ready)
				break
			}
			fmt.Fprintln(p.logs, sc.Text())
		}
		_, _ = io.Copy(p.logs, out)
		// Wait only after stdout is drained, as exec requires of StdoutPipe.
		p.done <- p.cmd.Wait()
		close(p.done)
	}()
	select {
	case <-ready:
		return p, nil
	case err := <-p.done:
		return nil, fmt.Errorf("river child exited before it was ready: %v\n%s", err, linewriter.Tail(p.logs.String(), 20))
	case <-time.After(60 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		return nil, fmt.Errorf("river child not ready within 60s\n%s", linewriter.Tail(p.logs.String(), 20))
	}
}

func (p *riverProc) pid() int { return p.cmd.Process.Pid }

// stop asks the child to stop (SIGTERM; SIGKILL after 30s) and returns the
// CPU seconds it spent in its life, exact from wait4's rusage.
func (p *riverProc) stop() (float64, error) {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	var err error
	select {
	case err = <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		err = fmt.Errorf("river child %d did not stop within 30s; killed it", p.pid())
	}
	if err != nil {
		return 0, fmt.Errorf("river child: %w\n%s", err, linewriter.Tail(p.logs.String(), 20))
	}
	return processCPU(p.cmd.ProcessState), nil
}

// startRiverProcs starts n River child processes at once, so that 16 start
// about as fast as one, and returns once each is ready. On error it returns
// those that started too, for the caller to stop.
func startRiverProcs(dsn string, rs riverSettings, n int) ([]*riverProc, error) {
	procs := make([]*riverProc, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { procs[i], errs[i] = startRiverProc(dsn, rs) })
	}
	wg.Wait()
	return slices.DeleteFunc(procs, func(p *riverProc) bool { return p == nil }), errors.Join(errs...)
}
