package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	srclient "github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// latencies summarises repeated timings, in seconds.
type latencies struct {
	What     string    `json:"what"`
	LeaseTTL string    `json:"lease_ttl,omitempty"`
	Trials   []float64 `json:"trials_s"`
	P50      float64   `json:"p50_s"`
	Max      float64   `json:"max_s"`
}

func summarize(what, ttl string, xs []float64) latencies {
	return latencies{What: what, LeaseTTL: ttl, Trials: xs, P50: median(xs), Max: slices.Max(xs)}
}

// faultDB is a database with the schema, reset between trials.
type faultDB struct {
	dsn    string
	st     *store.Store
	client *srclient.Tasks
}

func (e *env) faultDB(ctx context.Context, name string) (*faultDB, error) {
	dsn, err := e.database(ctx, name)
	if err != nil {
		return nil, err
	}
	st, err := store.Open(ctx, dsn, store.Options{MaxConns: 4})
	if err != nil {
		return nil, err
	}
	if err := st.Migrate(ctx); err != nil {
		st.Close()
		return nil, err
	}
	client, _ := srclient.New(st, srclient.Config{ShardCount: 256})
	return &faultDB{dsn: dsn, st: st, client: client}, nil
}

func (db *faultDB) reset(ctx context.Context) error {
	_, err := db.st.Pool().Exec(ctx, `TRUNCATE tasks, shard_fences`)
	return err
}

// load enqueues n sleep tasks of ms milliseconds spread over every shard.
func (db *faultDB) load(ctx context.Context, n, ms int) error {
	batch := make([]tasks.NewTask, n)
	for i := range batch {
		batch[i] = tasks.NewTask{Kind: "sleep", Payload: fmt.Appendf(nil, `{"ms": %d}`, ms)}
	}
	_, err := db.client.EnqueueBatch(ctx, batch)
	return err
}

// threeRunners starts runner-1..3 (runner-2 through a fault proxy if asked)
// and waits for balance.
func (e *env) threeRunners(ctx context.Context, dsn string, trial int, ttl time.Duration, proxy bool) (*cluster, error) {
	c := e.newCluster(fmt.Sprintf("f-%d-%d", trial, time.Now().UnixNano()), dsn, 256)
	for i := 1; i <= 3; i++ {
		if _, err := c.start(fmt.Sprintf("runner-%d", i), runnerOpts{leaseTTL: ttl, proxy: proxy && i == 2}); err != nil {
			c.stop()
			return nil, err
		}
	}
	if err := waitUntil(30*time.Second, func() bool { return c.balanced(ctx, "runner-1", "runner-2", "runner-3") }); err != nil {
		c.stop()
		return nil, fmt.Errorf("balance: %w", err)
	}
	return c, nil
}

func (e *env) failoverSection(ctx context.Context, rep *Report, trials int) error {
	db, err := e.faultDB(ctx, "failover")
	if err != nil {
		return err
	}
	defer db.st.Close()
	for _, ttl := range []time.Duration{2 * time.Second, 10 * time.Second} {
		var owned, firstTask []float64
		for trial := range trials {
			if err := db.reset(ctx); err != nil {
				return err
			}
			c, err := e.threeRunners(ctx, db.dsn, trial, ttl, false)
			if err != nil {
				return err
			}
			// Enough 200ms tasks to keep every runner busy past the failover.
			if err := db.load(ctx, int(ttl.Seconds()+5)*1200, 200); err != nil {
				return err
			}
			victim := c.runners[1]
			if err := waitUntil(10*time.Second, func() bool { return victim.metric("shardrun_tasks_in_flight") > 0 }); err != nil {
				return err
			}
			moved := c.shardsOf(ctx, victim.id)
			shardList := make([]int32, 0, len(moved))
			for s := range moved {
				shardList = append(shardList, int32(s))
			}
			killed := time.Now()
			_ = victim.cmd.Process.Signal(syscall.SIGKILL)
			if err := waitUntil(ttl+30*time.Second, func() bool {
				o, _ := c.owners(ctx)
				for s := range moved {
					if o[s] == "" || o[s] == victim.id {
						return false
					}
				}
				return true
			}); err != nil {
				return err
			}
			o := time.Since(killed)
			var first time.Time
			if err := waitUntil(ttl+30*time.Second, func() bool {
				err := db.st.Pool().QueryRow(ctx, `SELECT coalesce(min(finished_at), 'epoch') FROM tasks
					WHERE shard = ANY($1) AND state = 'completed' AND claimed_by <> $2 AND finished_at > $3`,
					shardList, victim.id, killed).Scan(&first)
				return err == nil && first.After(killed)
			}); err != nil {
				return err
			}
			c.stop()
			owned = append(owned, o.Seconds())
			firstTask = append(firstTask, first.Sub(killed).Seconds())
			fmt.Fprintf(e.log, "  TTL %s trial %d: shards owned again after %.2fs, first moved task done after %.2fs\n",
				ttl, trial+1, o.Seconds(), first.Sub(killed).Seconds())
		}
		rep.Failover = append(rep.Failover,
			summarize("all of the killed runner's shards owned again", ttl.String(), owned),
			summarize("first task of a moved shard completed", ttl.String(), firstTask))
	}
	return nil
}

func (e *env) handoffSection(ctx context.Context, rep *Report, trials int) error {
	db, err := e.faultDB(ctx, "handoff")
	if err != nil {
		return err
	}
	defer db.st.Close()
	var handoffs []float64
	for trial := range trials {
		if err := db.reset(ctx); err != nil {
			return err
		}
		c, err := e.threeRunners(ctx, db.dsn, trial, 10*time.Second, false)
		if err != nil {
			return err
		}
		if err := db.load(ctx, 20000, 50); err != nil {
			return err
		}
		leaver := c.runners[1]
		if err := waitUntil(10*time.Second, func() bool { return leaver.metric("shardrun_tasks_in_flight") > 0 }); err != nil {
			return err
		}
		moved := c.shardsOf(ctx, leaver.id)
		start := time.Now()
		_ = leaver.cmd.Process.Signal(syscall.SIGTERM)
		if err := waitUntil(30*time.Second, func() bool {
			o, _ := c.owners(ctx)
			for s := range moved {
				if o[s] == "" || o[s] == leaver.id {
					return false
				}
			}
			return true
		}); err != nil {
			return err
		}
		d := time.Since(start)
		c.stop()
		handoffs = append(handoffs, d.Seconds())
		fmt.Fprintf(e.log, "  trial %d: SIGTERM -> %d shards owned elsewhere after %.3fs (50ms tasks in flight)\n", trial+1, len(moved), d.Seconds())
	}
	l := summarize("SIGTERM one of 3 runners under load: its shards owned elsewhere", "10s", handoffs)
	rep.Handoff = &l
	return nil
}

// detachTrial is one blackhole trial: when the cut runner detached, relative
// to its own lease deadline, to etcd's expiry of its lease, and to the first
// acquisition of one of its shards by another runner.
type detachTrial struct {
	LeaseTTL           string  `json:"lease_ttl"`
	DetachAfterCutS    float64 `json:"detach_after_cut_s"`
	BeforeDeadlineS    float64 `json:"detached_before_lease_deadline_s"`
	BeforeExpiryS      float64 `json:"detached_before_etcd_expired_lease_s"`
	BeforeTakeoverS    float64 `json:"detached_before_first_takeover_s"`
	TakeoverAfterCutS  float64 `json:"first_takeover_after_cut_s"`
	DetachBeforeTakeOK bool    `json:"detach_strictly_before_takeover"`
}

func (e *env) detachSection(ctx context.Context, rep *Report, trials int) error {
	db, err := e.faultDB(ctx, "detach")
	if err != nil {
		return err
	}
	defer db.st.Close()
	for trial := range trials {
		if err := db.reset(ctx); err != nil {
			return err
		}
		c, err := e.threeRunners(ctx, db.dsn, trial, 2*time.Second, true)
		if err != nil {
			return err
		}
		victim := c.runners[1]
		moved := c.shardsOf(ctx, victim.id)
		w := e.watchPrefix(ctx, c.prefix(), c.shards)
		cut := time.Now()
		victim.proxy.Blackhole()
		err = waitUntil(30*time.Second, func() bool {
			o, _ := c.owners(ctx)
			for s := range moved {
				if o[s] == "" || o[s] == victim.id {
					return false
				}
			}
			return true
		})
		w.stop()
		if err != nil {
			c.stop()
			return err
		}
		detachedAt, fields, ok := victim.logTime("cannot prove the lease: detaching", cut)
		if !ok {
			c.stop()
			return fmt.Errorf("trial %d: no detach logged:\n%s", trial, linewriter.Tail(victim.logs.String(), 20))
		}
		deadline, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(fields["lease_deadline"]))
		expired, takeover := w.expiryAndTakeover(c.prefix(), victim.id, moved)
		c.stop()
		t := detachTrial{LeaseTTL: "2s", DetachAfterCutS: detachedAt.Sub(cut).Seconds(),
			BeforeDeadlineS: deadline.Sub(detachedAt).Seconds(), BeforeExpiryS: expired.Sub(detachedAt).Seconds(),
			BeforeTakeoverS: takeover.Sub(detachedAt).Seconds(), TakeoverAfterCutS: takeover.Sub(cut).Seconds()}
		t.DetachBeforeTakeOK = t.BeforeTakeoverS > 0
		rep.Detach = append(rep.Detach, t)
		fmt.Fprintf(e.log, "  trial %d: detached %.3fs after the cut, %.3fs before its lease deadline, %.3fs before etcd expired the lease, %.3fs before the first takeover\n",
			trial+1, t.DetachAfterCutS, t.BeforeDeadlineS, t.BeforeExpiryS, t.BeforeTakeoverS)
		if !t.DetachBeforeTakeOK {
			return fmt.Errorf("trial %d: the runner detached %.3fs AFTER another runner acquired its shard", trial, -t.BeforeTakeoverS)
		}
	}
	return nil
}

// prefixWatch records the puts and deletes under a prefix with their
// receive times.
type prefixWatch struct {
	mu     sync.Mutex
	events []watched
	cancel context.CancelFunc
	done   chan struct{}
}

// watched is a runner key's write or deletion, or a unit's change of hands
// (shard >= 0: shard.History).
type watched struct {
	at    time.Time
	put   bool
	key   string
	value string
	shard int
}

func (e *env) watchPrefix(ctx context.Context, prefix string, shards int) *prefixWatch {
	wctx, cancel := context.WithCancel(ctx)
	w := &prefixWatch{cancel: cancel, done: make(chan struct{})}
	ch := e.cli.Watch(wctx, prefix, clientv3.WithPrefix())
	units := shard.NewHistory(prefix, shards)
	go func() {
		defer close(w.done)
		for resp := range ch {
			now := time.Now()
			w.mu.Lock()
			for _, ev := range resp.Events {
				w.events = append(w.events, watched{at: now, put: ev.Type == clientv3.EventTypePut, key: string(ev.Kv.Key),
					value: string(ev.Kv.Value), shard: -1})
				for _, u := range units.Apply(ev) {
					w.events = append(w.events, watched{at: now, put: u.Acquired, value: u.Runner, shard: u.Shard})
				}
			}
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *prefixWatch) stop() { w.cancel(); <-w.done }

// expiryAndTakeover finds when etcd deleted the cut runner's registration
// (its lease expired) and when another runner first acquired one of its
// shards.
func (w *prefixWatch) expiryAndTakeover(prefix, runner string, shards map[int]bool) (expired, takeover time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, ev := range w.events {
		if !ev.put && ev.key == prefix+"runners/"+runner && expired.IsZero() {
			expired = ev.at
		}
		if ev.put && takeover.IsZero() && ev.value != runner && ev.shard >= 0 && shards[ev.shard] {
			takeover = ev.at
		}
	}
	return expired, takeover
}
