package schedule

import (
	"cmp"
	"context"
	"fmt"
	"regexp"
	"time"

	"github.com/shardrun/shardrun/internal/client"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// Definition is a schedule as a producer defines it: a name, the task to
// enqueue at each tick, and when it ticks.
type Definition struct {
	// Name identifies the schedule: 1 to 200 letters, digits, '.', '_',
	// '-' or ':'.
	Name string
	// Task is the task of each tick: its kind, payload and options. An
	// empty Key gives each tick's task a random key (and so a random
	// shard); MaxAttempts 0 is the enqueuing client's default. RunAfter,
	// Deadline and UniqueKey are not a schedule's: each tick's task runs at
	// its tick, and is its own.
	Task tasks.NewTask
	// SkipWhileUnfinished skips a tick, rather than enqueue it, while the
	// task of the schedule's last enqueued tick is unfinished (ready,
	// waiting or running): at most one of its tasks is unfinished at a
	// time, whether no runner handles the kind or a run outlasts the
	// interval. A skipped tick is counted (Skipped) and never enqueued.
	SkipWhileUnfinished bool
	// When it ticks: Every (with an optional Start, default one interval
	// after the definition) or Cron in Timezone.
	Every    time.Duration
	Start    time.Time
	Cron     string
	Timezone string
}

var namePattern = regexp.MustCompile(`^[A-Za-z0-9._:-]{1,200}$`)

// Store is what the catalog needs from the database (store.Store).
type Store interface {
	CreateSchedule(ctx context.Context, prepare func(now time.Time) (store.Schedule, error)) (store.Schedule, error)
	UpsertSchedule(ctx context.Context, prepare func(now time.Time) (store.Schedule, error)) (store.Schedule, store.Upserted, error)
	ListSchedules(ctx context.Context, after string, limit int) ([]store.Schedule, error)
	DeleteSchedule(ctx context.Context, name string) (bool, error)
}

// Catalog is the schedules: it defines, lists and deletes them, checking
// each definition as the scheduler will use it. It is what
// /api/schedules and the library's Config.Periodic use.
type Catalog struct {
	st   Store
	prep client.Config
}

// NewCatalog returns the schedules of st. prep is the task operations'
// configuration (the shard count and the default max_attempts), with
// which a definition's task is checked as every enqueued task is.
func NewCatalog(st Store, prep client.Config) (*Catalog, error) {
	prep = prep.WithDefaults()
	if err := prep.Validate(); err != nil {
		return nil, fmt.Errorf("schedule catalog: %w", err)
	}
	return &Catalog{st: st, prep: prep}, nil
}

// Prepare validates d and returns the row to store, with its first tick:
// the first tick from now on (an interval schedule without a start starts
// one interval after now). Create gives it the database's time.
func (c *Catalog) Prepare(d Definition, now time.Time) (store.Schedule, error) {
	if err := checkName(d.Name); err != nil {
		return store.Schedule{}, err
	}
	if err := checkTask(d.Task.Options); err != nil {
		return store.Schedule{}, err
	}
	// The task of a tick must be valid now, as it will be at every tick.
	in, err := c.prep.Prepare(d.Task, now)
	if err != nil {
		return store.Schedule{}, err
	}
	spec := Spec{Every: d.Every, Start: d.Start, Cron: d.Cron, Timezone: d.Timezone}
	if spec.Timezone == "" {
		spec.Timezone = "UTC"
	}
	if spec.Every > 0 && spec.Start.IsZero() {
		spec.Start = now.Add(spec.Every).Truncate(time.Millisecond)
	}
	timer, err := spec.Compile()
	if err != nil {
		field := "cron"
		if d.Every != 0 || d.Cron == "" {
			field = "every"
		}
		if d.Timezone != "" && d.Cron != "" {
			if _, zerr := time.LoadLocation(d.Timezone); zerr != nil {
				field = "timezone"
			}
		}
		return store.Schedule{}, &tasks.FieldError{Field: field, Problem: err.Error()}
	}
	first := timer.Next(now.Add(-time.Nanosecond))
	if first.Equal(Never) {
		return store.Schedule{}, &tasks.FieldError{Field: "cron", Problem: fmt.Sprintf("%q has no tick in the next five years", d.Cron)}
	}
	// Stored with the defaults every tick's task gets, but the key and
	// max_attempts chosen at each tick: a random key per task, the
	// enqueuing client's default.
	task := in.NewTask
	task.Key, task.MaxAttempts = d.Task.Key, d.Task.MaxAttempts
	sc := store.Schedule{Name: d.Name, Task: task, SkipWhileUnfinished: d.SkipWhileUnfinished,
		Every: spec.Every, Cron: spec.Cron, Timezone: spec.Timezone, Start: spec.Start, NextTick: first}
	if sc.Start.IsZero() {
		sc.Start = now
	}
	return sc, nil
}

// Create validates and stores a schedule; store.ErrScheduleExists when
// the name is taken. Its first tick is computed from the database's time
// (now() of the transaction that stores it), as every time rule of the
// scheduler is: a process whose clock runs ahead would skip ticks.
func (c *Catalog) Create(ctx context.Context, d Definition) (store.Schedule, error) {
	// Invalid definitions are refused before the database is asked.
	if _, err := c.Prepare(d, time.Now()); err != nil {
		return store.Schedule{}, err
	}
	return c.st.CreateSchedule(ctx, func(now time.Time) (store.Schedule, error) { return c.Prepare(d, now) })
}

// Upsert validates and stores a schedule whether or not one of its name
// exists (store.UpsertSchedule): the way a program declares its schedules
// at every start. A restart with the same definition changes nothing, and
// one that changes only the task keeps the next tick. The result says
// whether it was created, updated or unchanged.
func (c *Catalog) Upsert(ctx context.Context, d Definition) (store.Schedule, store.Upserted, error) {
	if d.Every > 0 && d.Start.IsZero() {
		// Declared without a start, an interval ticks at whole multiples of
		// itself since the Unix epoch, so that every start of the program
		// declares the same schedule (a start of "one interval from now"
		// would move the ticks at every restart).
		d.Start = time.Unix(0, 0).UTC()
	}
	if _, err := c.Prepare(d, time.Now()); err != nil {
		return store.Schedule{}, 0, err
	}
	return c.st.UpsertSchedule(ctx, func(now time.Time) (store.Schedule, error) { return c.Prepare(d, now) })
}

// ListRequest asks for one page of schedules, by name.
type ListRequest struct {
	// After is the cursor: the Next of the previous page ("": from the
	// first schedule).
	After string
	// Limit bounds the page: 1 to tasks.MaxListLimit, or 0 for
	// tasks.DefaultListLimit (as for tasks: Go's zero value is "not set").
	Limit int
}

// Page is one page of schedules. Next, when not "", is the cursor of the
// next page; the listing is complete once a page comes without one.
type Page struct {
	Schedules []store.Schedule
	Next      string
}

// Check validates the request before the database sees it: the limit
// in range, the cursor a schedule name. The *tasks.FieldError names the
// field.
func (req ListRequest) Check() error {
	switch {
	case req.Limit < 0 || req.Limit > tasks.MaxListLimit:
		return &tasks.FieldError{Field: "limit", Problem: fmt.Sprintf("must be 1 to %d (0 for the default, %d), got %d", tasks.MaxListLimit, tasks.DefaultListLimit, req.Limit)}
	case req.After != "" && !namePattern.MatchString(req.After):
		return &tasks.FieldError{Field: "after", Problem: fmt.Sprintf("must be a schedule name (the next of the previous page), got %q", req.After)}
	}
	return nil
}

// List returns one page of schedules by name; follow Page.Next (as
// req.After) until it is "".
func (c *Catalog) List(ctx context.Context, req ListRequest) (Page, error) {
	if err := req.Check(); err != nil {
		return Page{}, err
	}
	req.Limit = cmp.Or(req.Limit, tasks.DefaultListLimit)
	list, err := c.st.ListSchedules(ctx, req.After, req.Limit+1)
	if err != nil {
		return Page{}, err
	}
	p := Page{Schedules: list}
	if len(list) > req.Limit {
		p.Schedules = list[:req.Limit]
		p.Next = p.Schedules[req.Limit-1].Name
	}
	return p, nil
}

// Delete deletes the named schedule and reports whether it existed; the
// tasks it enqueued stay. A name no schedule can have is a
// *tasks.FieldError, before the database sees it (it may be text
// PostgreSQL refuses).
func (c *Catalog) Delete(ctx context.Context, name string) (bool, error) {
	if err := checkName(name); err != nil {
		return false, err
	}
	return c.st.DeleteSchedule(ctx, name)
}

// checkTask refuses the options that are not a schedule's task's, naming
// the field: each tick's task runs at its tick (run_after), and is its own
// (unique_key); a deadline would be one instant for every tick.
func checkTask(o tasks.Options) error {
	for _, f := range []struct {
		name string
		set  bool
	}{{"run_after", !o.RunAfter.IsZero()}, {"deadline", !o.Deadline.IsZero()}, {"unique_key", o.UniqueKey != ""}} {
		if f.set {
			return &tasks.FieldError{Field: f.name, Problem: "is not an option of a schedule's task: each tick's task runs at its tick and is its own"}
		}
	}
	return nil
}

// checkName reports whether name can name a schedule.
func checkName(name string) error {
	if !namePattern.MatchString(name) {
		return &tasks.FieldError{Field: "name", Problem: fmt.Sprintf("must be 1 to 200 letters, digits, '.', '_', '-' or ':', got %q", name)}
	}
	return nil
}

// TimerOf returns the timer of a stored schedule.
func TimerOf(sc store.Schedule) (Timer, error) {
	return Spec{Every: sc.Every, Start: sc.Start, Cron: sc.Cron, Timezone: sc.Timezone}.Compile()
}
