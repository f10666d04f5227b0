// Package schedule is shardrun's periodic tasks: a schedule enqueues a
// task at each of its ticks, every fixed interval or by a cron expression
// in a time zone. Schedules are defined through the Catalog (behind the
// coordinator's /api/schedules and the library's Config.Periodic), stored
// in PostgreSQL, and the leader's Scheduler enqueues each tick once.
//
// Exactly once: the Scheduler inserts a tick's task and moves the
// schedule's next tick past it in one transaction under the coordinator
// fence, and tasks carry (schedule, tick) under a unique index. A deposed
// leader's transaction either committed before the new leader raised the
// fence, and the new leader sees the next tick moved, or applies nothing.
//
// Missed ticks: ticks that came due while no leader ran (before the
// current leadership term began) are collapsed: only the latest of them is
// enqueued, once, and the others are counted as skipped on the schedule
// and in shardrun_schedule_ticks_skipped_total. Every tick that comes due
// during a term is enqueued, even if the leader enqueues it late (a slow
// database, a long pass). A tick's task has run_after = the tick.
//
// Skip while unfinished: a schedule defined with SkipWhileUnfinished
// enqueues no tick while the task of its last enqueued tick is unfinished
// (ready, waiting or running); such ticks are skipped for good, counted
// on the schedule and in shardrun_schedule_ticks_skipped_total{reason=
// "unfinished"}. Without it, a schedule whose kind no runner handles
// piles up one ready task per tick.
package schedule

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// MinEvery is the shortest interval of an interval schedule.
const MinEvery = time.Second

// Spec is when a schedule ticks: every Every from Start, or at the times
// Cron matches in Timezone. Exactly one of Every and Cron is set.
type Spec struct {
	// Every is the interval of an interval schedule; ticks are Start,
	// Start+Every, Start+2·Every, …
	Every time.Duration
	// Start anchors an interval schedule (its first tick).
	Start time.Time
	// Cron is a standard five-field cron expression (minute hour
	// day-of-month month day-of-week) or a descriptor such as @daily or
	// @hourly, evaluated in Timezone.
	Cron string
	// Timezone is an IANA zone name; default UTC.
	Timezone string
}

// Timer computes a spec's ticks.
type Timer interface {
	// Next returns the first tick strictly after t.
	Next(t time.Time) time.Time
}

// ErrSpec is matched (errors.Is) by every invalid spec.
var ErrSpec = errors.New("invalid schedule")

// parser is robfig/cron's standard five fields plus descriptors.
var parser = cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// Compile validates the spec and returns its timer.
func (s Spec) Compile() (Timer, error) {
	switch {
	case s.Every != 0 && s.Cron != "":
		return nil, fmt.Errorf("%w: give either every or cron, not both", ErrSpec)
	case s.Every == 0 && s.Cron == "":
		return nil, fmt.Errorf("%w: give every (an interval) or cron (an expression)", ErrSpec)
	case s.Every != 0 && s.Every < MinEvery:
		return nil, fmt.Errorf("%w: every must be at least %s, got %s", ErrSpec, MinEvery, s.Every)
	case s.Every%time.Millisecond != 0:
		return nil, fmt.Errorf("%w: every must be whole milliseconds, got %s", ErrSpec, s.Every)
	}
	loc, err := time.LoadLocation(s.Timezone)
	if s.Timezone == "" {
		loc, err = time.UTC, nil
	}
	if err != nil || strings.EqualFold(s.Timezone, "local") {
		return nil, fmt.Errorf("%w: unknown time zone %q (an IANA name such as Europe/Berlin)", ErrSpec, s.Timezone)
	}
	if s.Every != 0 {
		if s.Start.IsZero() {
			return nil, fmt.Errorf("%w: an interval schedule needs a start", ErrSpec)
		}
		return interval{start: s.Start, every: s.Every}, nil
	}
	expr := strings.TrimSpace(s.Cron)
	if strings.HasPrefix(expr, "TZ=") || strings.HasPrefix(expr, "CRON_TZ=") {
		return nil, fmt.Errorf("%w: give the time zone as timezone, not in the cron expression", ErrSpec)
	}
	if strings.HasPrefix(expr, "@every") {
		return nil, fmt.Errorf("%w: use every for intervals, not @every", ErrSpec)
	}
	sched, err := parser.Parse(expr)
	if err != nil {
		return nil, fmt.Errorf("%w: cron %q: %v", ErrSpec, s.Cron, err)
	}
	spec, ok := sched.(*cron.SpecSchedule)
	if !ok {
		return nil, fmt.Errorf("%w: cron %q is not a calendar expression", ErrSpec, s.Cron)
	}
	spec.Location = loc
	// A cron expression that never matches (30 February) would give zero.
	if spec.Next(time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)).IsZero() {
		return nil, fmt.Errorf("%w: cron %q never matches", ErrSpec, s.Cron)
	}
	return calendar{spec: spec, fixed: fixedTime(expr)}, nil
}

// fixedTime reports whether a cron expression runs at particular times of
// day: neither its minute nor its hour field is a wildcard ('*', '*/n'),
// and it is not @hourly. Vixie cron runs such a job once when the clocks
// go back and repeat its wall time, and a wildcard job on real time.
func fixedTime(expr string) bool {
	if strings.HasPrefix(expr, "@") {
		return expr != "@hourly"
	}
	f := strings.Fields(expr)
	return len(f) >= 2 && !strings.HasPrefix(f[0], "*") && !strings.HasPrefix(f[1], "*")
}

type interval struct {
	start time.Time
	every time.Duration
}

func (iv interval) Next(t time.Time) time.Time {
	if t.Before(iv.start) {
		return iv.start
	}
	k := t.Sub(iv.start)/iv.every + 1
	return iv.start.Add(k * iv.every)
}

// calendar is a cron expression's timer. A wall time repeated by clocks
// going back ticks once, at its first occurrence, when the expression is
// fixedTime; robfig/cron would tick at both. A wall time skipped by clocks
// going forward does not tick (robfig/cron's behaviour, kept).
type calendar struct {
	spec  *cron.SpecSchedule
	fixed bool
}

// Never is the next tick of a cron expression with no match left (robfig
// gives up after five years without one).
var Never = time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)

func (c calendar) Next(t time.Time) time.Time {
	for {
		n := c.spec.Next(t)
		if n.IsZero() {
			return Never
		}
		if !c.fixed || !repeatedWallTime(n.In(c.spec.Location)) {
			return n.UTC()
		}
		t = n
	}
}

// repeatedWallTime reports whether the wall time of t (in its location)
// already occurred an instant earlier: t lies within the stretch that
// clocks going back at the start of t's zone period repeat.
func repeatedWallTime(t time.Time) bool {
	start, _ := t.ZoneBounds()
	if start.IsZero() {
		return false
	}
	_, offset := t.Zone()
	_, before := start.Add(-time.Nanosecond).Zone()
	back := time.Duration(before-offset) * time.Second
	return back > 0 && t.Before(start.Add(back))
}

// maxTicksPerPlan bounds the ticks one schedule enqueues in one batch; the
// rest follow in the next batch.
const maxTicksPerPlan = 100

// Plan decides which ticks of a schedule whose next tick is next are
// enqueued at now, when the current leadership term began at termStart
// (both by the database clock): ticks before termStart came due while no
// leader ran, and only the latest of them is enqueued (the others are
// skipped); every tick from termStart to now is enqueued. It returns the
// ticks, the next tick after them and how many were skipped. At most
// maxTicksPerPlan ticks are returned; next is then the first one left.
func Plan(t Timer, next, now, termStart time.Time) (ticks []time.Time, after time.Time, skipped int64) {
	at := next
	var missed time.Time // the latest tick before termStart
	if iv, ok := t.(interval); ok && at.Before(termStart) && !at.After(now) {
		// Closed form: an interval schedule left alone for a year would
		// otherwise take millions of steps.
		last := termStart.Add(-time.Nanosecond)
		if now.Before(last) {
			last = now
		}
		k := int64(last.Sub(at) / iv.every)
		skipped, missed, at = k, at.Add(time.Duration(k)*iv.every), at.Add(time.Duration(k+1)*iv.every)
	}
	for !at.After(now) && at.Before(termStart) {
		if !missed.IsZero() {
			skipped++
		}
		missed = at
		at = t.Next(at)
	}
	if !missed.IsZero() {
		ticks = append(ticks, missed)
	}
	for !at.After(now) && len(ticks) < maxTicksPerPlan {
		ticks = append(ticks, at)
		at = t.Next(at)
	}
	return ticks, at, skipped
}
