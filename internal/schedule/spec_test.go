package schedule

import (
	"errors"
	"testing"
	"time"
)

func TestCompile(t *testing.T) {
	start := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name string
		spec Spec
		ok   bool
	}{
		{"interval", Spec{Every: time.Minute, Start: start}, true},
		{"cron", Spec{Cron: "*/5 * * * *"}, true},
		{"descriptor", Spec{Cron: "@daily", Timezone: "Asia/Tokyo"}, true},
		{"both", Spec{Every: time.Minute, Start: start, Cron: "* * * * *"}, false},
		{"neither", Spec{}, false},
		{"interval below a second", Spec{Every: 500 * time.Millisecond, Start: start}, false},
		{"interval without start", Spec{Every: time.Minute}, false},
		{"six fields", Spec{Cron: "0 * * * * *"}, false},
		{"garbage", Spec{Cron: "every day"}, false},
		{"@every", Spec{Cron: "@every 5m"}, false},
		{"zone in the expression", Spec{Cron: "CRON_TZ=Europe/Berlin 0 9 * * *"}, false},
		{"unknown zone", Spec{Cron: "0 9 * * *", Timezone: "Mars/Olympus"}, false},
		{"Local", Spec{Cron: "0 9 * * *", Timezone: "Local"}, false},
		{"never", Spec{Cron: "0 0 30 2 *"}, false},
	} {
		_, err := tc.spec.Compile()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrSpec)) {
			t.Errorf("%s: %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

func TestCronFollowsTheTimeZone(t *testing.T) {
	timer, err := Spec{Cron: "0 9 * * *", Timezone: "Europe/Berlin"}.Compile()
	if err != nil {
		t.Fatal(err)
	}
	winter := timer.Next(time.Date(2026, 1, 10, 12, 0, 0, 0, time.UTC))
	summer := timer.Next(time.Date(2026, 7, 10, 12, 0, 0, 0, time.UTC))
	if want := time.Date(2026, 1, 11, 8, 0, 0, 0, time.UTC); !winter.Equal(want) {
		t.Errorf("09:00 Berlin in January = %s, want %s", winter, want)
	}
	if want := time.Date(2026, 7, 11, 7, 0, 0, 0, time.UTC); !summer.Equal(want) {
		t.Errorf("09:00 Berlin in July = %s, want %s", summer, want)
	}
	// The spring-forward night has no 02:30 in Berlin: robfig/cron does not
	// tick that night (documented in docs/tasks.md), the next tick is the
	// following night's.
	night, _ := Spec{Cron: "30 2 * * *", Timezone: "Europe/Berlin"}.Compile()
	got := night.Next(time.Date(2026, 3, 28, 12, 0, 0, 0, time.UTC))
	if want := time.Date(2026, 3, 30, 0, 30, 0, 0, time.UTC); !got.Equal(want) {
		t.Errorf("02:30 Berlin after the night clocks go forward: %s, want %s", got, want)
	}
}

func TestIntervalTicks(t *testing.T) {
	start := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	timer, _ := Spec{Every: 10 * time.Second, Start: start}.Compile()
	for _, tc := range []struct{ after, want time.Time }{
		{start.Add(-time.Hour), start},
		{start, start.Add(10 * time.Second)},
		{start.Add(25 * time.Second), start.Add(30 * time.Second)},
		{start.Add(30 * time.Second), start.Add(40 * time.Second)},
	} {
		if got := timer.Next(tc.after); !got.Equal(tc.want) {
			t.Errorf("Next(%s) = %s, want %s", tc.after, got, tc.want)
		}
	}
}

// The missed-tick policy: ticks before the term began collapse to the
// latest of them; ticks during the term are all enqueued.
func TestPlanMissedTickPolicy(t *testing.T) {
	t0 := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	sec := func(f float64) time.Time { return t0.Add(time.Duration(f * float64(time.Second))) }
	every, _ := Spec{Every: time.Second, Start: t0}.Compile()
	cron, _ := Spec{Cron: "* * * * *"}.Compile() // every minute, stepped tick by tick
	min := func(f float64) time.Time { return t0.Add(time.Duration(f * float64(time.Minute))) }
	for _, tc := range []struct {
		name                 string
		timer                Timer
		next, now, termStart time.Time
		ticks                []time.Time
		after                time.Time
		skipped              int64
	}{
		{"all due ticks came due in the term", every, sec(0), sec(2.5), sec(-1),
			[]time.Time{sec(0), sec(1), sec(2)}, sec(3), 0},
		{"missed before the term: the latest once, then the term's", every, sec(0), sec(7.2), sec(5.5),
			[]time.Time{sec(5), sec(6), sec(7)}, sec(8), 5},
		{"first pass of a term after a long gap", every, sec(0), sec(3600.1), sec(3600.05),
			[]time.Time{sec(3600)}, sec(3601), 3600},
		{"nothing due", every, sec(5), sec(4.9), sec(0), nil, sec(5), 0},
		{"cron, missed before the term", cron, min(0), min(10.5), min(10.5),
			[]time.Time{min(10)}, min(11), 10},
		{"cron, in the term", cron, min(0), min(2), min(-1),
			[]time.Time{min(0), min(1), min(2)}, min(3), 0},
	} {
		ticks, after, skipped := Plan(tc.timer, tc.next, tc.now, tc.termStart)
		if len(ticks) != len(tc.ticks) || !after.Equal(tc.after) || skipped != tc.skipped {
			t.Errorf("%s: ticks %v, next %s, skipped %d; want %v, %s, %d", tc.name, ticks, after, skipped, tc.ticks, tc.after, tc.skipped)
			continue
		}
		for i := range ticks {
			if !ticks[i].Equal(tc.ticks[i]) {
				t.Errorf("%s: tick %d = %s, want %s", tc.name, i, ticks[i], tc.ticks[i])
			}
		}
	}
	// A long backlog inside the term comes in bounded plans.
	ticks, after, _ := Plan(every, sec(0), sec(1000), sec(-1))
	if len(ticks) != maxTicksPerPlan || !after.Equal(sec(maxTicksPerPlan)) {
		t.Errorf("a backlog of 1000 ticks: %d ticks, next %s", len(ticks), after)
	}
}

// The night clocks go back repeats an hour of wall time. A cron
// expression with a fixed minute and hour ticks once in it, at the first
// occurrence, as Vixie cron runs such jobs once; one with a wildcard in
// its minute or hour field (or @hourly) keeps ticking on real time, as
// Vixie cron runs wildcard jobs.
func TestCronTicksOnceWhenClocksGoBack(t *testing.T) {
	utc := func(mo time.Month, d, h, m int) time.Time { return time.Date(2026, mo, d, h, m, 0, 0, time.UTC) }
	for _, tc := range []struct {
		name, cron, zone string
		from             time.Time
		want             []time.Time
	}{
		{"02:30 Berlin", "30 2 * * *", "Europe/Berlin", utc(10, 24, 12, 0),
			[]time.Time{utc(10, 25, 0, 30), utc(10, 26, 1, 30), utc(10, 27, 1, 30)}},
		{"01:30 New York", "30 1 * * *", "America/New_York", utc(10, 31, 12, 0),
			[]time.Time{utc(11, 1, 5, 30), utc(11, 2, 6, 30)}},
		{"a list of fixed times in the repeated hour", "0,45 2 * * *", "Europe/Berlin", utc(10, 24, 12, 0),
			[]time.Time{utc(10, 25, 0, 0), utc(10, 25, 0, 45), utc(10, 26, 1, 0)}},
		{"hourly keeps real time", "30 * * * *", "Europe/Berlin", utc(10, 25, 0, 0),
			[]time.Time{utc(10, 25, 0, 30), utc(10, 25, 1, 30), utc(10, 25, 2, 30)}},
		{"@hourly keeps real time", "@hourly", "America/New_York", utc(11, 1, 4, 30),
			[]time.Time{utc(11, 1, 5, 0), utc(11, 1, 6, 0), utc(11, 1, 7, 0)}},
		{"a wildcard minute keeps real time", "*/30 2 * * *", "Europe/Berlin", utc(10, 24, 12, 0),
			[]time.Time{utc(10, 25, 0, 0), utc(10, 25, 0, 30), utc(10, 25, 1, 0), utc(10, 25, 1, 30), utc(10, 26, 1, 0)}},
	} {
		timer, err := Spec{Cron: tc.cron, Timezone: tc.zone}.Compile()
		if err != nil {
			t.Fatal(err)
		}
		at := tc.from
		for i, want := range tc.want {
			if at = timer.Next(at); !at.Equal(want) {
				t.Errorf("%s: tick %d = %s, want %s", tc.name, i, at, want)
				break
			}
		}
	}
	// Between the two occurrences (a schedule created at 00:45Z) the next
	// tick is the next night's: the wall time 02:30 has passed.
	timer, _ := Spec{Cron: "30 2 * * *", Timezone: "Europe/Berlin"}.Compile()
	if got, want := timer.Next(utc(10, 25, 0, 45)), utc(10, 26, 1, 30); !got.Equal(want) {
		t.Errorf("02:30 Berlin after its first occurrence: %s, want %s", got, want)
	}
	// The scheduler's plan over the night, as a leader running through it
	// sees it: one tick.
	ticks, _, skipped := Plan(timer, utc(10, 25, 0, 30), utc(10, 25, 3, 0), utc(10, 24, 0, 0))
	if len(ticks) != 1 || skipped != 0 {
		t.Errorf("ticks of the night clocks go back: %v (skipped %d), want one", ticks, skipped)
	}
}
