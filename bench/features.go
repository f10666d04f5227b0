package main

// Issue 26's figures: what queues, priorities and sequences cost or give.
// One queue against the default queue, 10,000 sequences burnt down with an
// order check, and urgent tasks' enqueue-to-start latency while a backlog
// of less urgent ones drains.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/tasks"
)

// featuresOpts are the features section's flags.
type featuresOpts struct {
	procs                  int
	sequences, sequenceLen int
	backlog, rate, seconds int
}

var featuresFlags = featuresOpts{procs: 3, sequences: 10_000, sequenceLen: 20, backlog: 200_000, rate: 50, seconds: 10}

// featuresQueue is the named queue of the one-queue trials.
const featuresQueue = "bench"

// featuresResult is the features section's report.
type featuresResult struct {
	Processes  int          `json:"processes"`
	MaxWorkers int          `json:"max_workers_per_process"`
	Queue      *queueCost   `json:"one_queue,omitempty"`
	Sequences  *sequenceRun `json:"sequences,omitempty"`
	Priorities *priorityRun `json:"priorities_under_load,omitempty"`
}

// queueCost is the noop burn-down with every task in one named queue that
// the runners name (--queues), paired with the same run in the default
// queue without the flag.
type queueCost struct {
	What          string    `json:"what"`
	Tasks         int       `json:"tasks"`
	Default       []float64 `json:"tasks_per_s_default_queue"`
	Named         []float64 `json:"tasks_per_s_named_queue"`
	Ratios        []float64 `json:"ratios_named_over_default"`
	MedianRatio   float64   `json:"median_named_over_default"`
	MedianDefault float64   `json:"median_tasks_per_s_default_queue"`
	// ThroughputSection is the median of the throughput section's shardrun
	// trials at the same process count, for reference (0: not run).
	ThroughputSection float64    `json:"throughput_section_median_tasks_per_s,omitempty"`
	Trials            []burnDown `json:"trials"`
}

// sequenceRun is the burn-down of many sequences and its order check.
type sequenceRun struct {
	What        string   `json:"what"`
	Sequences   int      `json:"sequences"`
	PerSequence int      `json:"tasks_per_sequence"`
	Trial       burnDown `json:"trial"`
	// TasksPerS against the default-queue trials' median of the one-queue
	// figure: the same noop burn-down and process count without sequences.
	PlainTasksPerS float64 `json:"plain_median_tasks_per_s,omitempty"`
	RatioToPlain   float64 `json:"ratio_to_plain,omitempty"`
	// The order check, from the database.
	InOrder bool `json:"in_order"`
	// Checked is the sequences found, Short those with fewer or more
	// tasks than PerSequence, Unstarted the tasks without both times or
	// claimed after they finished.
	Checked   int `json:"sequences_checked"`
	Short     int `json:"sequences_of_another_length"`
	Unstarted int `json:"tasks_without_claim_or_finish"`
	// Overlaps is the tasks claimed before the task before them (by id) in
	// their sequence finished.
	Overlaps int      `json:"tasks_started_before_predecessor_finished"`
	Examples []string `json:"examples,omitempty"`
	// Retried tasks ran more than once: the table keeps their last
	// attempt's times only.
	Retried int `json:"tasks_with_more_than_one_attempt"`
	// The gap from a task's finish to its successor's claim.
	StepP50MS float64 `json:"step_gap_p50_ms"`
	StepP99MS float64 `json:"step_gap_p99_ms"`
}

// priorityRun is the enqueue-to-start latency of tasks enqueued one by
// one while a backlog of default-priority tasks drains.
type priorityRun struct {
	What      string  `json:"what"`
	Backlog   int     `json:"backlog_tasks"`
	Rate      int     `json:"tasks_per_s_per_trickle"`
	TrickleS  float64 `json:"trickle_s"`
	DrainS    float64 `json:"backlog_drain_s"`
	DrainPerS float64 `json:"backlog_drain_tasks_per_s"`
	// Urgent and Default are enqueued by client.Enqueue, UrgentTx by
	// client.EnqueueTx in a transaction of the bench's (the insert
	// trigger's notification, which marks the shards of urgent tasks,
	// rather than the store's notification after a quiet insert).
	Urgent   priorityLatency `json:"urgent_priority_1"`
	UrgentTx priorityLatency `json:"urgent_priority_1_enqueue_tx"`
	Default  priorityLatency `json:"default_priority_3"`
}

// priorityLatency is claimed_at - created_at of one trickle's tasks
// created while the backlog still had tasks to claim.
type priorityLatency struct {
	Enqueued    int     `json:"enqueued"`
	DuringDrain int     `json:"created_during_drain"`
	P50MS       float64 `json:"latency_p50_ms"`
	P95MS       float64 `json:"latency_p95_ms"`
	P99MS       float64 `json:"latency_p99_ms"`
	MaxMS       float64 `json:"latency_max_ms"`
}

func (e *env) featuresSection(ctx context.Context, rep *Report, trials, n int) error {
	procs := featuresFlags.procs
	f := &featuresResult{Processes: procs, MaxWorkers: cmp.Or(tuning.shardrunWorkers[procs], 512)}
	rep.Features = f
	// Each figure runs whatever became of the one before it.
	var errs []error
	var err error
	if f.Queue, err = e.queueFigure(ctx, f, trials, n, rep.Throughput); err != nil {
		errs = append(errs, fmt.Errorf("one queue: %w", err))
	}
	if f.Sequences, err = e.sequenceFigure(ctx, f); err != nil {
		errs = append(errs, fmt.Errorf("sequences: %w", err))
	} else if s := f.Sequences; !s.InOrder {
		errs = append(errs, fmt.Errorf("sequences out of order: %s (%s)", s.orderFound(), strings.Join(s.Examples, "; ")))
	}
	if f.Priorities, err = e.priorityFigure(ctx, f); err != nil {
		errs = append(errs, fmt.Errorf("priorities: %w", err))
	}
	return errors.Join(errs...)
}

// queueFigure runs trials pairs of noop burn-downs: every task in the
// default queue and the runners without --queues, and every task in
// featuresQueue and the runners with --queues featuresQueue (one lane per
// shard and kind in both). The pairs alternate which runs first, so that
// a trial's place in its pair does not side with either.
func (e *env) queueFigure(ctx context.Context, f *featuresResult, trials, n int, throughput []burnDown) (*queueCost, error) {
	q := &queueCost{Tasks: n,
		What: fmt.Sprintf("noop burn-down of %d tasks at %d processes (--max-workers %d), each trial in a fresh database, the tasks inserted before the runners start: "+
			"every task in the default queue and runners without --queues (the build before queues behaved so) against every task in queue %q and runners with --queues %s; "+
			"%d pairs, the default queue first in the 1st, 3rd... and second in the others; the ratio is named ÷ default per pair; trials lists each pair default first", n, f.Processes, f.MaxWorkers, featuresQueue, featuresQueue, trials)}
	var ref []float64
	for _, t := range throughput {
		if t.System == "shardrun" && t.Processes == f.Processes {
			ref = append(ref, t.TasksPerS)
		}
	}
	q.ThroughputSection = median(ref)
	for trial := range trials {
		base := trialOpts{label: "fq", trial: trial, processes: f.Processes, n: n, maxWorkers: f.MaxWorkers}
		named := base
		named.label, named.queues = "fqn", featuresQueue
		named.task = func(int) tasks.NewTask {
			return tasks.NewTask{Kind: "noop", Options: tasks.Options{Queue: featuresQueue}}
		}
		var def, nq burnDown
		arms := []struct {
			name string
			o    trialOpts
			into *burnDown
		}{{"default queue", base, &def}, {"queue " + featuresQueue, named, &nq}}
		if trial%2 == 1 {
			arms[0], arms[1] = arms[1], arms[0]
		}
		for _, a := range arms {
			var err error
			if *a.into, err = e.shardrunBurnDown(ctx, a.o); err != nil {
				return q, fmt.Errorf("%s: %w", a.name, err)
			}
		}
		q.Default, q.Named = append(q.Default, def.TasksPerS), append(q.Named, nq.TasksPerS)
		q.Ratios = append(q.Ratios, nq.TasksPerS/def.TasksPerS)
		q.Trials = append(q.Trials, def, nq)
		fmt.Fprintf(e.log, "  one queue, pair %d: default queue %.0f tasks/s, queue %s %.0f tasks/s, ratio %.3f\n",
			trial+1, def.TasksPerS, featuresQueue, nq.TasksPerS, nq.TasksPerS/def.TasksPerS)
	}
	q.MedianRatio, q.MedianDefault = median(q.Ratios), median(q.Default)
	return q, nil
}

// sequenceFigure burns down featuresFlags.sequences sequences of
// featuresFlags.sequenceLen noop tasks each, every sequence's tasks
// enqueued one after another, and checks from the database that each
// sequence's tasks ran one at a time in id (enqueue) order.
func (e *env) sequenceFigure(ctx context.Context, f *featuresResult) (*sequenceRun, error) {
	seqs, per := featuresFlags.sequences, featuresFlags.sequenceLen
	s := &sequenceRun{Sequences: seqs, PerSequence: per,
		What: fmt.Sprintf("noop burn-down of %d sequences of %d tasks (sequence_key seq-N, each sequence's tasks one after another in enqueue order, so in id order; batches of %d, each its own transaction) at %d processes (--max-workers %d), "+
			"inserted before the runners start, timed from the first claim to the last completion; then, from the tasks table, each task of a sequence must be claimed no earlier than the task before it (by id) finished",
			seqs, per, insertBatch, f.Processes, f.MaxWorkers)}
	o := trialOpts{label: "fseq", processes: f.Processes, n: seqs * per, maxWorkers: f.MaxWorkers,
		task: func(i int) tasks.NewTask {
			return tasks.NewTask{Kind: "noop", Options: tasks.Options{SequenceKey: fmt.Sprintf("seq-%d", i/per)}}
		},
		check: s.check}
	var err error
	if s.Trial, err = e.shardrunBurnDown(ctx, o); err != nil {
		return s, err
	}
	if q := f.Queue; q != nil && q.MedianDefault > 0 {
		s.PlainTasksPerS, s.RatioToPlain = q.MedianDefault, s.Trial.TasksPerS/q.MedianDefault
	}
	fmt.Fprintf(e.log, "  %d sequences of %d: %.0f tasks/s (%.2f of the plain burn-down); in order %v (%s); step gap p50 %.1f ms, p99 %.1f ms\n",
		seqs, per, s.Trial.TasksPerS, s.RatioToPlain, s.InOrder, s.orderFound(), s.StepP50MS, s.StepP99MS)
	return s, nil
}

// check reads the order of every sequence from the tasks table, which
// keeps a finished task's last claim (claimed_at) and its finish
// (finished_at), both from the database's clock.
func (s *sequenceRun) check(ctx context.Context, pool *pgxpool.Pool) error {
	var gaps []float64
	err := pool.QueryRow(ctx, benchTag+`
		WITH t AS (
			SELECT sequence_key, id, claimed_at, finished_at, attempt,
				lag(finished_at) OVER w AS prev_finished, lag(id) OVER w AS prev_id
			FROM tasks WHERE kind = 'noop' WINDOW w AS (PARTITION BY sequence_key ORDER BY id)
		), per AS (SELECT sequence_key, count(*) AS n FROM t GROUP BY sequence_key)
		SELECT (SELECT count(*) FROM per)::int, (SELECT count(*) FROM per WHERE n <> $1)::int,
			count(*) FILTER (WHERE claimed_at IS NULL OR finished_at IS NULL OR claimed_at > finished_at)::int,
			count(*) FILTER (WHERE claimed_at < prev_finished)::int,
			count(*) FILTER (WHERE attempt > 1)::int,
			coalesce(percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM claimed_at - prev_finished) * 1000)
				FILTER (WHERE prev_finished IS NOT NULL), '{0,0}'),
			coalesce((array_agg(format('%s: task %s claimed %s ms before task %s finished', sequence_key, id,
					round((extract(epoch FROM prev_finished - claimed_at) * 1000)::numeric, 3), prev_id) ORDER BY sequence_key, id)
				FILTER (WHERE claimed_at < prev_finished))[1:5], '{}')
		FROM t`, s.PerSequence).Scan(&s.Checked, &s.Short, &s.Unstarted, &s.Overlaps, &s.Retried, &gaps, &s.Examples)
	if err != nil {
		return fmt.Errorf("checking the sequences' order: %w", err)
	}
	s.StepP50MS, s.StepP99MS = gaps[0], gaps[1]
	s.InOrder = s.Checked == s.Sequences && s.Short == 0 && s.Unstarted == 0 && s.Overlaps == 0
	return nil
}

// orderFound is what the order check found.
func (s *sequenceRun) orderFound() string {
	return fmt.Sprintf("%d of %d sequences found, %d of another length, %d tasks without claim or finish, %d started before their predecessor finished",
		s.Checked, s.Sequences, s.Short, s.Unstarted, s.Overlaps)
}

// priorityFigure starts the runners, waits until they own balanced
// shards, enqueues a backlog of default-priority noop tasks in one
// transaction and then, for featuresFlags.seconds, three trickles of noop
// tasks one per statement at featuresFlags.rate per second each: priority
// 1 by client.Enqueue, priority 1 by client.EnqueueTx, the default
// priority 3 by client.Enqueue. Each trickle's tasks carry its name in
// their payload. The latencies count the trickled tasks created before
// the backlog's last task was claimed.
func (e *env) priorityFigure(ctx context.Context, f *featuresResult) (p *priorityRun, err error) {
	backlog, rate, window := featuresFlags.backlog, featuresFlags.rate, time.Duration(featuresFlags.seconds)*time.Second
	p = &priorityRun{Backlog: backlog, Rate: rate,
		What: fmt.Sprintf("%d processes (--max-workers %d) own balanced shards; %d noop tasks of the default priority (3) are enqueued in one transaction; from its commit, for %s, "+
			"noop tasks are enqueued one per statement (open loop) at %d/s in each of three trickles: priority 1 by client.Enqueue (a quiet insert, notified by the store after its commit), "+
			"priority 1 by client.EnqueueTx in the bench's own transaction (notified by the insert trigger at the commit), priority 3 by client.Enqueue; "+
			"latency is claimed_at - created_at (database clock) of the tasks created before the backlog's last task was claimed; the backlog's drain from its first claim to its last completion",
			f.Processes, f.MaxWorkers, backlog, window, rate)}
	st, dsn, drop, err := e.trialStore(ctx, "sr_fprio", 16)
	if err != nil {
		return p, err
	}
	defer func() {
		if dropErr := drop(); err == nil {
			err = dropErr
		}
	}()
	cfg := srclient.Config{ShardCount: 256}.WithDefaults()
	client, err := srclient.New(st, cfg)
	if err != nil {
		return p, err
	}
	c := e.newCluster(fmt.Sprintf("fprio-%d", time.Now().UnixNano()), dsn, 256)
	defer c.stop()
	rps, err := c.startAll(f.Processes, runnerOpts{leaseTTL: 10 * time.Second, maxWorkers: f.MaxWorkers})
	if err != nil {
		return p, err
	}
	var ids []string
	for _, rp := range rps {
		ids = append(ids, rp.id)
	}
	if err := waitEvery(time.Minute, 50*time.Millisecond, func() bool { return c.balanced(ctx, ids...) }); err != nil {
		return p, fmt.Errorf("shards not balanced among %d runners: %w", f.Processes, err)
	}
	if _, err := enqueueNoopsAtOnce(ctx, st, cfg, backlog); err != nil {
		return p, err
	}
	trickles := []struct {
		name     string
		priority int
		tx       bool
		into     *priorityLatency
	}{
		{"urgent", tasks.MostUrgent, false, &p.Urgent},
		{"urgent-tx", tasks.MostUrgent, true, &p.UrgentTx},
		{"default", tasks.DefaultPriority, false, &p.Default},
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make([]error, len(trickles))
	for i, t := range trickles {
		task := tasks.NewTask{Kind: "noop", Payload: json.RawMessage(fmt.Sprintf(`{"trickle": %q}`, t.name)), Options: tasks.Options{Priority: t.priority}}
		one := func(ctx context.Context) error {
			_, err := client.Enqueue(ctx, task)
			return err
		}
		if t.tx {
			one = func(ctx context.Context) error {
				return pgx.BeginFunc(ctx, st.Pool(), func(tx pgx.Tx) error {
					_, err := client.EnqueueTx(ctx, tx, task)
					return err
				})
			}
		}
		wg.Go(func() { errs[i] = produce(ctx, stop, "single", rate, one, nil) })
	}
	began := time.Now()
	time.Sleep(window) // the trickles' fixed length, not a wait for a condition
	close(stop)
	wg.Wait()
	p.TrickleS = time.Since(began).Seconds()
	if err := errors.Join(errs...); err != nil {
		return p, fmt.Errorf("enqueueing one by one: %w", err)
	}
	var total int
	if err := st.Pool().QueryRow(ctx, benchTag+`SELECT count(*) FROM tasks WHERE kind = 'noop'`).Scan(&total); err != nil {
		return p, fmt.Errorf("counting the tasks: %w", err)
	}
	if err := waitBurnedDown(ctx, st.Pool(), rps, "noop", total); err != nil {
		return p, err
	}
	const backlogTasks = `kind = 'noop' AND payload->>'trickle' IS NULL`
	err = st.Pool().QueryRow(ctx, benchTag+`SELECT extract(epoch FROM max(finished_at) - min(claimed_at)) FROM tasks WHERE `+backlogTasks).Scan(&p.DrainS)
	if err != nil {
		return p, fmt.Errorf("reading the backlog's drain: %w", err)
	}
	p.DrainPerS = float64(backlog) / p.DrainS
	for _, t := range trickles {
		var pct []float64
		err := st.Pool().QueryRow(ctx, benchTag+`
			SELECT count(*)::int, count(*) FILTER (WHERE created_at < b.last_claim)::int,
				coalesce(percentile_cont(ARRAY[0.5, 0.95, 0.99, 1]) WITHIN GROUP (ORDER BY extract(epoch FROM claimed_at - created_at) * 1000)
					FILTER (WHERE created_at < b.last_claim), '{0,0,0,0}')
			FROM tasks, (SELECT max(claimed_at) AS last_claim FROM tasks WHERE `+backlogTasks+`) b
			WHERE payload->>'trickle' = $1`, t.name).Scan(&t.into.Enqueued, &t.into.DuringDrain, &pct)
		if err != nil {
			return p, fmt.Errorf("reading the latencies of trickle %s: %w", t.name, err)
		}
		t.into.P50MS, t.into.P95MS, t.into.P99MS, t.into.MaxMS = pct[0], pct[1], pct[2], pct[3]
	}
	fmt.Fprintf(e.log, "  priorities, backlog of %d drained at %.0f tasks/s in %.1f s: p50/p95/p99 priority 1 %s; priority 1 in the producer's transaction %s; priority 3 %s\n",
		backlog, p.DrainPerS, p.DrainS, p.Urgent, p.UrgentTx, p.Default)
	return p, nil
}

// String is the latencies and how many tasks they count.
func (l priorityLatency) String() string {
	return fmt.Sprintf("%.1f/%.1f/%.1f ms (%d of %d enqueued during the drain)", l.P50MS, l.P95MS, l.P99MS, l.DuringDrain, l.Enqueued)
}

// printFeatures adds the features section's rows.
func printFeatures(w io.Writer, f *featuresResult) {
	if q := f.Queue; q != nil && len(q.Ratios) > 0 {
		ref := "throughput section not run"
		if q.ThroughputSection > 0 {
			ref = fmt.Sprintf("throughput section's median at %d processes %s tasks/s", f.Processes, fmtThousands(int(q.ThroughputSection+0.5)))
		}
		fmt.Fprintf(w, "| one queue, no priorities: %d processes, %s noop tasks, all in queue %s (--queues %s) vs all in default | %s vs %s tasks/s (medians); ratio median **%.3f** (per pair %s); %s |\n",
			f.Processes, fmtThousands(q.Tasks), featuresQueue, featuresQueue, fmtThousands(int(median(q.Named)+0.5)), fmtThousands(int(q.MedianDefault+0.5)),
			q.MedianRatio, fmtList(q.Ratios), ref)
	}
	if s := f.Sequences; s != nil && s.Trial.TasksPerS > 0 {
		fmt.Fprintf(w, "| %s sequences of %d noop tasks, %d processes | %s tasks/s", fmtThousands(s.Sequences), s.PerSequence, f.Processes, fmtThousands(int(s.Trial.TasksPerS+0.5)))
		if s.PlainTasksPerS > 0 {
			fmt.Fprintf(w, " (%.2f × the plain burn-down's %s)", s.RatioToPlain, fmtThousands(int(s.PlainTasksPerS+0.5)))
		}
		fmt.Fprintf(w, "; in order: **%v** (%s); step gap p50 %.1f ms, p99 %.1f ms |\n", s.InOrder, s.orderFound(), s.StepP50MS, s.StepP99MS)
	}
	if p := f.Priorities; p != nil && p.DrainS > 0 {
		fmt.Fprintf(w, "| priorities under load: enqueue→start p50/p95/p99 of tasks enqueued one by one at %d/s per trickle while %s default-priority tasks drain, %d processes | priority 1 (client.Enqueue) **%s**; priority 1 (client.EnqueueTx) %s; priority 3 %s; backlog drained at %s tasks/s |\n",
			p.Rate, fmtThousands(p.Backlog), f.Processes, p.Urgent, p.UrgentTx, p.Default, fmtThousands(int(p.DrainPerS+0.5)))
	}
}
