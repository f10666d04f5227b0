package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/tracing/tracingtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// The wakeup section: the wake-up path of a task, hop by hop, from the
// producer's commit to its handler's start (issue 41). The steady
// section's shardrun setup and producers (3 runners, 256 shards, open-loop
// producers in the bench process) with the runners' traces exported to a
// receiver in the bench process, a LISTEN connection of the bench's own
// beside the runners', and each enqueue's commit time recorded where it
// returned. All clocks are this machine's: the database's, the bench's
// and the runners' are one.

// wakeupHop is one hop of the path, over the window's tasks where it is
// defined.
type wakeupHop struct {
	Name  string  `json:"name"`
	Tasks int     `json:"tasks"`
	P50MS float64 `json:"p50_ms"`
	P99MS float64 `json:"p99_ms"`
}

// wakeupRun is the hops of one rate and producer mode.
type wakeupRun struct {
	Mode  string      `json:"mode"`
	Rate  int         `json:"rate"`
	Tasks int         `json:"tasks"`
	Hops  []wakeupHop `json:"hops"`
	// Woken is the share of the window's tasks claimed by a round a
	// notification started; the others were claimed by a round that
	// followed another (a claim that filled its limit) or by the poll.
	Woken float64 `json:"woken_share"`
}

// wakeupSpans are what the runners' traces tell of one task.
type wakeupSpans struct {
	claimStart, claimEnd, runStart time.Time
	notified, woke                 time.Time // zero: no notification started the claim's round
}

func (e *env) wakeupSection(ctx context.Context, rep *Report) error {
	rcv := tracingtest.Start(false)
	defer rcv.Close()
	// A queue big enough that no span is dropped at these rates, and a
	// short export delay so that the spans are in before the section
	// reads them.
	tap := shardrunTap{env: []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=" + rcv.URL(), "OTEL_BSP_MAX_QUEUE_SIZE=262144", "OTEL_BSP_SCHEDULE_DELAY=200"}}
	window := time.Duration(steadyFlags.seconds) * time.Second
	rep.Notes = append(rep.Notes, fmt.Sprintf("wakeup: the wake-up path hop by hop, the steady section's shardrun setup (%d runners, %d workers each, 256 shards, open-loop producers, %s window after a %s warm-up) with the runners' spans exported to a receiver in the bench process (every span: tracing costs the runners CPU, so the steady section's latencies, measured without it, are the headline), a LISTEN connection of the bench's own beside the runners', and each enqueue's commit time taken where it returned; hops: insert and commit (created_at, the transaction's start, to the commit's return), commit to the notification at a listener (the bench's: every listener gets it at once), commit to the notification at the runner (the listener's callback), the runner's loop waking for it, the loop to its claim statement, the claim statement, the claim's return to the handler's start; total created_at to handler start",
		steadyFlags.procs, steadyWorkers, window, steadyWarmup))
	for _, rate := range []int{1000, 5000} {
		for _, mode := range []string{"single", "batched"} {
			run, err := e.wakeupOnce(ctx, rcv, tap, rate, mode, window)
			if err != nil {
				return fmt.Errorf("%d/s %s: %w", rate, mode, err)
			}
			rep.Wakeup = append(rep.Wakeup, run)
			fmt.Fprintf(e.log, "  %d/s %s: %s\n", rate, mode, fmtHops(run))
		}
	}
	return nil
}

func (e *env) wakeupOnce(ctx context.Context, rcv *tracingtest.Receiver, tap shardrunTap, rate int, mode string, window time.Duration) (wakeupRun, error) {
	run := wakeupRun{Mode: mode, Rate: rate}
	var mu sync.Mutex
	committed := map[int64]time.Time{}
	var batches []sentBatch // the enqueues that reported no ids
	tap.committed = func(sent, at time.Time, ts []tasks.Enqueued) {
		mu.Lock()
		defer mu.Unlock()
		if len(ts) == 0 {
			batches = append(batches, sentBatch{sent, at})
		}
		for _, t := range ts {
			committed[t.ID] = at
		}
	}
	sys, err := e.steadyShardrun(ctx, steadyFlags.procs, tap)
	if err != nil {
		return run, err
	}
	lctx, stopListening := context.WithCancel(ctx)
	heard := &notifications{byShard: map[int][]time.Time{}}
	listenErr := make(chan error, 1)
	go func() { listenErr <- heard.listen(lctx, sys.pool.Config().ConnConfig.Copy()) }()
	steady, err := e.steadyOnce(ctx, sys, rate, mode, window)
	stopListening()
	if lerr := <-listenErr; err == nil && lerr != nil && lctx.Err() == nil {
		err = lerr
	}
	type row struct {
		id      int64
		shard   int
		created time.Time
	}
	var rows []row
	if err == nil {
		var rs pgx.Rows
		rs, err = sys.pool.Query(ctx, `SELECT id, shard, created_at FROM tasks WHERE created_at >= $1 AND created_at < $2`, steady.from, steady.to)
		if err == nil {
			for rs.Next() {
				var r row
				if err = rs.Scan(&r.id, &r.shard, &r.created); err != nil {
					break
				}
				rows = append(rows, r)
			}
			rs.Close()
			if err == nil {
				err = rs.Err()
			}
		}
	}
	// Stopping the runners (SIGTERM) flushes their spans.
	if stopErr := sys.stop(); err == nil {
		err = stopErr
	}
	if err != nil {
		return run, err
	}
	spans := taskSpans(rcv.Spans())
	hops := map[string][]float64{}
	names := []string{"insert and commit", "commit → notification at a listener", "commit → notification at the runner", "notification → loop woke",
		"loop woke → claim sent", "claim statement", "claim returned → handler started", "total: created_at → handler started"}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	woken := 0
	for _, r := range rows {
		s, ok := spans[r.id]
		at, hasCommit := committed[r.id]
		if !hasCommit {
			at, hasCommit = commitOf(batches, r.created)
		}
		if !ok || !hasCommit || s.runStart.IsZero() {
			continue
		}
		run.Tasks++
		hops[names[0]] = append(hops[names[0]], ms(at.Sub(r.created)))
		if n, ok := heard.first(r.shard, r.created); ok {
			hops[names[1]] = append(hops[names[1]], ms(n.Sub(at)))
		}
		if !s.notified.IsZero() && !s.notified.Before(r.created) {
			woken++
			hops[names[2]] = append(hops[names[2]], ms(s.notified.Sub(at)))
			hops[names[3]] = append(hops[names[3]], ms(s.woke.Sub(s.notified)))
			hops[names[4]] = append(hops[names[4]], ms(s.claimStart.Sub(s.woke)))
		}
		hops[names[5]] = append(hops[names[5]], ms(s.claimEnd.Sub(s.claimStart)))
		hops[names[6]] = append(hops[names[6]], ms(s.runStart.Sub(s.claimEnd)))
		hops[names[7]] = append(hops[names[7]], ms(s.runStart.Sub(r.created)))
	}
	if run.Tasks == 0 {
		return run, fmt.Errorf("no task of the window has its commit, claim and run spans (%d tasks, %d with spans)", len(rows), len(spans))
	}
	run.Woken = float64(woken) / float64(run.Tasks)
	for _, name := range names {
		xs := hops[name]
		h := wakeupHop{Name: name, Tasks: len(xs)}
		if len(xs) > 0 {
			sort.Float64s(xs)
			h.P50MS, h.P99MS = quantile(xs, 0.5), quantile(xs, 0.99)
		}
		run.Hops = append(run.Hops, h)
	}
	return run, nil
}

// sentBatch is an enqueue that reported no task ids: when it was sent and
// when its commit returned.
type sentBatch struct{ sent, committed time.Time }

// commitOf is the commit of the enqueue that created a task at created
// (its transaction's start): the first to return of those in flight
// then. The batches are in the order they returned.
func commitOf(bs []sentBatch, created time.Time) (time.Time, bool) {
	for _, b := range bs {
		if !b.sent.After(created) && !b.committed.Before(created) {
			return b.committed, true
		}
	}
	return time.Time{}, false
}

// quantile of sorted xs, nearest rank.
func quantile(xs []float64, q float64) float64 {
	i := int(q*float64(len(xs))+0.5) - 1
	return xs[min(max(i, 0), len(xs)-1)]
}

// taskSpans gathers each task's claim and run spans and its claim
// batch's wake-up attributes.
func taskSpans(all []tracingtest.Span) map[int64]wakeupSpans {
	batches := map[string]tracingtest.Span{}
	for _, s := range all {
		if s.Name == "shardrun.claim_batch" {
			batches[s.SpanID] = s
		}
	}
	unix := func(v any) time.Time {
		if n, ok := v.(int64); ok {
			return time.Unix(0, n)
		}
		return time.Time{}
	}
	out := map[int64]wakeupSpans{}
	for _, s := range all {
		id, ok := s.Attrs["shardrun.task.id"].(int64)
		if !ok {
			continue
		}
		w := out[id]
		switch s.Name {
		case "shardrun.claim":
			w.claimStart, w.claimEnd = s.Start, s.End
			for _, l := range s.Links {
				if b, ok := batches[l.SpanID]; ok {
					w.notified, w.woke = unix(b.Attrs["shardrun.wake.notified_unix_nano"]), unix(b.Attrs["shardrun.wake.woke_unix_nano"])
				}
			}
		case "shardrun.run":
			w.runStart = s.Start
		default:
			continue
		}
		out[id] = w
	}
	return out
}

// notifications are the enqueue notifications a listener of the bench's
// own received, by shard.
type notifications struct {
	mu      sync.Mutex
	byShard map[int][]time.Time
	all     []time.Time
}

func (n *notifications) listen(ctx context.Context, cfg *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connecting the bench's listener: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+store.NotifyChannel); err != nil {
		return fmt.Errorf("listening: %w", err)
	}
	for {
		msg, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		at := time.Now()
		n.mu.Lock()
		if msg.Payload == "" || msg.Payload == "*" {
			n.all = append(n.all, at)
		}
		for _, p := range strings.Split(msg.Payload, ",") {
			if s, err := strconv.Atoi(strings.TrimPrefix(p, "!")); err == nil {
				n.byShard[s] = append(n.byShard[s], at)
			}
		}
		n.mu.Unlock()
	}
}

// first is the first notification naming shard (or every shard) received
// at or after from.
func (n *notifications) first(shard int, from time.Time) (time.Time, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var best time.Time
	for _, ts := range [][]time.Time{n.byShard[shard], n.all} {
		i, _ := slices.BinarySearchFunc(ts, from, func(a, b time.Time) int { return a.Compare(b) })
		if i < len(ts) && (best.IsZero() || ts[i].Before(best)) {
			best = ts[i]
		}
	}
	return best, !best.IsZero()
}

func fmtHops(r wakeupRun) string {
	var parts []string
	for _, h := range r.Hops {
		parts = append(parts, fmt.Sprintf("%s %.2f/%.2f", h.Name, h.P50MS, h.P99MS))
	}
	return fmt.Sprintf("%d tasks, %.0f%% claimed by a round a notification started; p50/p99 ms: %s", r.Tasks, 100*r.Woken, strings.Join(parts, "; "))
}

// printWakeup writes the hops of each run as a table.
func printWakeup(w io.Writer, runs []wakeupRun) {
	if len(runs) == 0 {
		return
	}
	fmt.Fprintln(w, "\nWake-up path (p50/p99 ms):")
	for _, r := range runs {
		fmt.Fprintf(w, "  %d/s %s: %s\n", r.Rate, r.Mode, fmtHops(r))
	}
}
