package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/runner"
)

// runnerChildFlag, as the first argument, makes the bench binary a shardrun
// runner (runnerChild) instead of the bench: the runner library with the
// built-in handlers and benchKindCount more kinds (k00, k01...), so that
// the mixed section can run fleets of many kinds, which bin/runner (three
// built-in kinds) cannot. Its one other argument is a runnerChildConfig in
// JSON.
const runnerChildFlag = "-runner-child"

// runnerChildConfig is what the bench tells a runner child: the settings of
// runner.Config it sets over runner.DefaultConfig() (a zero field keeps
// the default), and the kinds it registers and handles.
type runnerChildConfig struct {
	EtcdEndpoints  []string      `json:"etcd_endpoints,omitempty"`
	Cluster        string        `json:"cluster,omitempty"`
	ShardCount     int           `json:"shard_count,omitempty"`
	DatabaseURL    string        `json:"database_url,omitempty"`
	RunnerID       string        `json:"runner_id,omitempty"`
	AdminAddr      string        `json:"admin_addr,omitempty"`
	LeaseTTL       time.Duration `json:"lease_ttl,omitempty"`
	RecoveryWindow time.Duration `json:"recovery_window,omitempty"`
	HandoffTimeout time.Duration `json:"handoff_timeout,omitempty"`
	MaxWorkers     int           `json:"max_workers,omitempty"`
	DBMaxConns     int           `json:"db_max_conns,omitempty"`
	// Queues is runner.Config.Queues (name -> limit, 0: --max-workers);
	// empty: the default queue.
	Queues map[string]int `json:"queues,omitempty"`
	// KindCount kinds k00, k01... are registered beside the built-ins,
	// each with the built-in sleep handler: an empty payload returns at
	// once (a noop), {"ms": N} sleeps N ms.
	KindCount int `json:"kind_count"`
	// Kinds is runner.Config.Kinds: the registered kinds the runner
	// handles, which with its queues make its capability group; empty:
	// all of them.
	Kinds []string `json:"kinds,omitempty"`
}

// benchKind is the i-th kind of the runner children (k00, k01...).
func benchKind(i int) string { return fmt.Sprintf("k%02d", i) }

// benchKinds is benchKind(from) to benchKind(to-1).
func benchKinds(from, to int) []string {
	var out []string
	for i := from; i < to; i++ {
		out = append(out, benchKind(i))
	}
	return out
}

// overlay sets the given settings over cfg.
func (c runnerChildConfig) overlay(cfg *runner.Config) {
	set := func(dst *string, v string) {
		if v != "" {
			*dst = v
		}
	}
	setInt := func(dst *int, v int) {
		if v != 0 {
			*dst = v
		}
	}
	setDur := func(dst *time.Duration, v time.Duration) {
		if v != 0 {
			*dst = v
		}
	}
	if len(c.EtcdEndpoints) > 0 {
		cfg.EtcdEndpoints = c.EtcdEndpoints
	}
	set(&cfg.Cluster, c.Cluster)
	set(&cfg.DatabaseURL, c.DatabaseURL)
	set(&cfg.RunnerID, c.RunnerID)
	set(&cfg.AdminAddr, c.AdminAddr)
	setInt(&cfg.ShardCount, c.ShardCount)
	setInt(&cfg.MaxWorkers, c.MaxWorkers)
	setInt(&cfg.DBMaxConns, c.DBMaxConns)
	setDur(&cfg.LeaseTTL, c.LeaseTTL)
	setDur(&cfg.RecoveryWindow, c.RecoveryWindow)
	setDur(&cfg.HandoffTimeout, c.HandoffTimeout)
	if len(c.Queues) > 0 {
		cfg.Queues = c.Queues
	}
	if len(c.Kinds) > 0 {
		cfg.Kinds = c.Kinds
	}
}

// runnerChild is the child mode: a runner as cmd/runner builds one (JSON
// logs on stderr), with the kinds of its config, until SIGTERM or SIGINT;
// then it drains as the runner binary does.
func runnerChild(args []string) int {
	if len(args) != 1 {
		fmt.Fprintf(os.Stderr, "runner child: usage: %s '<json config>'\n", runnerChildFlag)
		return 2
	}
	if err := runRunnerChild(args[0]); err != nil {
		fmt.Fprintf(os.Stderr, "runner child: %s\n", cli.OneLine(err))
		return 1
	}
	return 0
}

func runRunnerChild(spec string) error {
	var c runnerChildConfig
	dec := json.NewDecoder(strings.NewReader(spec))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return fmt.Errorf("reading the config: %w", err)
	}
	log, err := cli.NewLogger("runner", "info", "json", os.Stderr)
	if err != nil {
		return err
	}
	cfg := runner.DefaultConfig()
	c.overlay(&cfg)
	cfg.Logger = log
	r, err := runner.New(cfg)
	if err != nil {
		return fmt.Errorf("configuring the runner: %w", err)
	}
	if err := r.HandleBuiltins(); err != nil {
		return fmt.Errorf("registering the built-in handlers: %w", err)
	}
	sleep := runner.Builtins(log.Named("builtin"))["sleep"]
	for i := range c.KindCount {
		if err := r.Handle(benchKind(i), sleep); err != nil {
			return fmt.Errorf("registering kind %s: %w", benchKind(i), err)
		}
	}
	ctx, stop := cli.SignalContext(log)
	defer stop()
	if err := r.Run(ctx); err != nil {
		return fmt.Errorf("running: %w", err)
	}
	return nil
}
