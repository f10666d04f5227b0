package leader

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/store"
)

// Event is one pass, as tests see it.
type Event struct {
	Service  string
	Epoch    int64
	Started  time.Time
	Duration time.Duration
	// Statements the pass ran.
	Statements int
	// Detail is the service's Result.Detail.
	Detail any
	Err    error
	// NotLeader: the fence holds a newer leader; the term ended.
	NotLeader bool
}

// Config configures a Loop.
type Config struct {
	Clock  clock.Clock
	Logger hclog.Logger
	// Registry receives the errors counter of every service (nil: not
	// registered).
	Registry prometheus.Registerer
}

type entry struct {
	svc    Service
	log    hclog.Logger
	errors prometheus.Counter
}

// Loop runs the leader's services for one leadership term at a time.
type Loop struct {
	// Events, when set before Run, receives every pass; tests wait on it.
	// Nil in production.
	Events *testsignal.Signal[Event]

	cfg      Config
	services []entry
}

// New returns a loop over services; it registers their errors counters.
func New(cfg Config, services ...Service) *Loop {
	cfg.Clock = cmp.Or(cfg.Clock, clock.Real())
	cfg.Logger = cmp.Or(cfg.Logger, hclog.NewNullLogger())
	f := promauto.With(cfg.Registry)
	l := &Loop{cfg: cfg}
	for _, s := range services {
		l.services = append(l.services, entry{svc: s, log: cfg.Logger.Named(s.Name()),
			errors: f.NewCounter(prometheus.CounterOpts{Name: fmt.Sprintf("shardrun_%s_errors_total", s.Name()),
				Help: fmt.Sprintf("Passes of the leader's %s service that failed.", s.Name())})})
	}
	return l
}

// Run runs every service under epoch until ctx ends (the term ends) or a
// pass finds the coordinator fence moved to a newer leader: then it ends
// the other services' passes too and returns store.ErrNotLeader.
func (l *Loop) Run(ctx context.Context, epoch int64) error {
	lctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	start := l.cfg.Clock.Now()
	var wg sync.WaitGroup
	for _, e := range l.services {
		term := Term{Epoch: epoch, Start: start, Clock: l.cfg.Clock, Log: e.log}
		wg.Go(func() {
			if err := l.run(lctx, e, term); err != nil {
				cancel(err)
			}
		})
	}
	wg.Wait()
	if err := context.Cause(lctx); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// run is one service's passes for one term.
func (l *Loop) run(ctx context.Context, e entry, term Term) error {
	e.svc.Begin(term)
	var wake <-chan struct{}
	if w, ok := e.svc.(Waker); ok {
		wake = w.Wake()
	}
	t := term.Clock.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C():
		case <-wake:
			t.Stop()
		}
		p := &Pass{Term: term, Started: term.Clock.Now(), errors: e.errors}
		r := e.svc.Pass(ctx, p)
		ev := Event{Service: e.svc.Name(), Epoch: term.Epoch, Started: p.Started, Duration: term.Clock.Now().Sub(p.Started),
			Statements: p.Statements, Detail: r.Detail, Err: r.Err, NotLeader: errors.Is(r.Err, store.ErrNotLeader)}
		switch {
		case ev.NotLeader:
			e.log.Warn("the coordinator fence holds a newer leader; stopping", "epoch", term.Epoch)
		case r.Err != nil && ctx.Err() == nil:
			e.errors.Inc()
			e.log.Error("pass failed", "error", r.Err, "duration", ev.Duration)
		}
		l.Events.Emit(ev)
		if ev.NotLeader {
			return store.ErrNotLeader
		}
		t.Reset(r.Next)
	}
}
