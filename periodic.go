package shardrun

import (
	"context"
	"fmt"
	"time"

	"github.com/shardrun/shardrun/internal/schedule"
	"github.com/shardrun/shardrun/store"
)

// PeriodicTask is a task enqueued at every tick of a schedule, declared in
// Config.Periodic. It ticks Every interval (at whole multiples of it since
// the Unix epoch, unless Start says from when) or by Cron (five fields, in
// Timezone, default UTC). Opts are each tick's task's options; RunAfter,
// Deadline and UniqueKey are not a schedule's (each tick is its own task,
// at most one per tick, run at its tick).
type PeriodicTask struct {
	// Name identifies the schedule: 1 to 200 letters, digits, '.', '_',
	// '-' or ':'.
	Name     string
	Every    time.Duration
	Start    time.Time
	Cron     string
	Timezone string
	Args     Args
	Opts     *EnqueueOpts
	// SkipWhileUnfinished skips a tick, rather than enqueue its task,
	// while the task of the last tick enqueued is unfinished (ready,
	// waiting or running): at most one task of the schedule is unfinished
	// at a time. Without it every tick is enqueued, and a kind no runner
	// handles piles up one ready task per tick. Skipped ticks are counted
	// (the schedule's skipped, shardrun_schedule_ticks_skipped_total
	// {reason="unfinished"}) and never enqueued later.
	SkipWhileUnfinished bool
}

// declare stores p, or updates the schedule of its name to it.
func (c *Client) declare(ctx context.Context, p PeriodicTask) error {
	n, err := newTask(p.Args, p.Opts)
	if err != nil {
		return fmt.Errorf("shardrun: periodic task %q: %w", p.Name, err)
	}
	d := schedule.Definition{Name: p.Name, Task: n, SkipWhileUnfinished: p.SkipWhileUnfinished,
		Every: p.Every, Start: p.Start, Cron: p.Cron, Timezone: p.Timezone}
	sc, what, err := c.schedules.Upsert(ctx, d)
	if err != nil {
		return fmt.Errorf("shardrun: periodic task %q: %w", p.Name, err)
	}
	if what != store.ScheduleUnchanged {
		c.log.Info("periodic task declared", "name", sc.Name, "kind", sc.Task.Kind, "next", sc.NextTick, "created", what == store.ScheduleCreated)
	}
	return nil
}
