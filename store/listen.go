package store

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/clock"
)

// NotifyChannel is the channel the tasks table's insert trigger notifies.
const NotifyChannel = "shardrun_tasks"

// Notification tells which shards got new ready tasks, and which of them
// got tasks more urgent than the default priority. All is set when the
// list was too long for a notification, and after (re)connecting, when
// notifications may have been missed.
type Notification struct {
	All    bool
	Shards []int
	Urgent []int
}

// Listener holds a dedicated connection that LISTENs for enqueue
// notifications and hands them to a callback. It reconnects by itself.
type Listener struct {
	cfg *pgx.ConnConfig
	log hclog.Logger
	fn  func(Notification)
}

// NewListener returns a listener on the store's database; fn is called from
// the listener's goroutine and must not block.
func (s *Store) NewListener(log hclog.Logger, fn func(Notification)) *Listener {
	return &Listener{cfg: s.pool.Config().ConnConfig.Copy(), log: log, fn: fn}
}

// Run listens until ctx ends.
func (l *Listener) Run(ctx context.Context) error {
	// Capped low: after a database restart the All wake-up sent on
	// reconnecting is what ends the runner's claim backoff, so the first
	// task starts within this cap of the database's return, whatever the
	// outage's length. One connection attempt per runner every 100 ms is
	// nothing to a database that is starting.
	backoff := clock.Backoff{Min: 20 * time.Millisecond, Max: 100 * time.Millisecond}
	for ctx.Err() == nil {
		err := l.listen(ctx)
		if ctx.Err() != nil {
			return nil
		}
		wait := backoff.Next()
		l.log.Warn("notification listener disconnected; reconnecting", "error", err, "backoff", wait)
		if !clock.Sleep(clock.Real(), wait, ctx.Done()) {
			return nil
		}
	}
	return nil
}

func (l *Listener) listen(ctx context.Context) error {
	conn, err := pgx.ConnectConfig(ctx, l.cfg)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+NotifyChannel); err != nil {
		return err
	}
	l.fn(Notification{All: true})
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		l.fn(parseNotification(n.Payload))
	}
}

func parseNotification(payload string) Notification {
	if payload == "" || payload == "*" {
		return Notification{All: true}
	}
	parts := strings.Split(payload, ",")
	n := Notification{Shards: make([]int, 0, len(parts))}
	for _, p := range parts {
		urgent := strings.HasPrefix(p, "!")
		v, err := strconv.Atoi(strings.TrimPrefix(p, "!"))
		if err != nil {
			return Notification{All: true}
		}
		n.Shards = append(n.Shards, v)
		if urgent {
			n.Urgent = append(n.Urgent, v)
		}
	}
	return n
}
