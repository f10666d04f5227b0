package main

// The targets of issues 23, 26, 31, 35, 39 and 40, each judged from this run's measurements.

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
)

// target is one row of the targets table.
type target struct {
	Measure  string `json:"measure"`
	Target   string `json:"target"`
	Measured string `json:"measured"`
	// Status is pass, fail, or not measured (its section did not run).
	Status string `json:"status"`
}

const notMeasured = "not measured"

func verdict(ok bool) string {
	if ok {
		return "pass"
	}
	return "fail"
}

// targets judges the targets from the report's sections.
func targets(rep *Report) []target {
	var out []target
	for _, procs := range []int{1, 3} {
		t := target{Measure: fmt.Sprintf("noop burn-down, %d process(es), shardrun ÷ River", procs),
			Target: "median ≥ 1.5, no trial below 1.2", Status: notMeasured}
		for _, r := range rep.Ratios {
			if r.Processes == procs && len(r.PerTrial) > 0 {
				t.Measured = fmt.Sprintf("median %.2f (trials %s)", r.Median, fmtList(r.PerTrial))
				t.Status = verdict(r.Median >= 1.5 && slices.Min(r.PerTrial) >= 1.2)
			}
		}
		out = append(out, t)
	}
	out = append(out, curveTargets(rep.Curve)...)
	out = append(out, costTargets(rep.Throughput)...)
	out = append(out, steadyTargets(rep.Steady)...)
	out = append(out, unclaimableTargets(rep.Unclaimable)...)
	out = append(out, featuresTargets(rep.Features)...)
	out = append(out, mixedTargets(rep.Mixed)...)
	out = append(out, workTargets(rep.Work)...)
	out = append(out, startupTargets(rep.Startup)...)
	out = append(out, outageTargets(rep.Outage)...)
	out = append(out, databasesTargets(rep.Databases)...)
	return out
}

// featuresTargets (issue 26): every task in one named queue burns down
// within 5% of the same run in the default queue (at most 5% slower), and
// every sequence ran in order.
func featuresTargets(f *featuresResult) []target {
	queue := target{Measure: "noop burn-down, one named queue (--queues) ÷ the default queue, no priorities", Target: "median ≥ 0.95 (at most 5% slower)", Status: notMeasured}
	order := target{Measure: "sequences of noop tasks: each task claimed after the one before it (by id) finished", Target: "every sequence", Status: notMeasured}
	if f == nil {
		return []target{queue, order}
	}
	if q := f.Queue; q != nil && len(q.Ratios) > 0 {
		queue.Measure = fmt.Sprintf("noop burn-down, %d processes, one named queue (--queues) ÷ the default queue, no priorities", f.Processes)
		queue.Measured = fmt.Sprintf("median %.3f (pairs %s)", q.MedianRatio, fmtList(q.Ratios))
		queue.Status = verdict(q.MedianRatio >= 0.95)
	}
	if s := f.Sequences; s != nil && s.Checked > 0 {
		order.Measure = fmt.Sprintf("%s sequences of %d noop tasks: each task claimed after the one before it (by id) finished", fmtThousands(s.Sequences), s.PerSequence)
		order.Measured = s.orderFound()
		order.Status = verdict(s.InOrder)
	}
	return []target{queue, order}
}

// curveTargets: shardrun's scale curve never falls as processes are added,
// its last point is at least 0.9 of its best, and its pages per claimed
// task stay within 2x of each other.
func curveTargets(c *curveResult) []target {
	rise := target{Measure: "scale curve (shardrun medians)", Target: "never falls as processes are added", Status: notMeasured}
	last := target{Measure: "scale curve, most processes ÷ best point", Target: "≥ 0.9", Status: notMeasured}
	pages := target{Measure: "pages read per claimed task across the scale curve (shardrun medians)", Target: "flat: largest ≤ 2 × smallest", Status: notMeasured}
	if c == nil || len(c.Points) == 0 {
		return []target{rise, last, pages}
	}
	var parts []string
	worst, best := 1.0, 0.0
	var pagesAt []float64
	var pageParts []string
	for i, pt := range c.Points {
		v := pt.MedianTasksPerS["shardrun"]
		parts = append(parts, fmt.Sprintf("%d: %.0f", pt.Processes, v))
		if i > 0 && c.Points[i-1].MedianTasksPerS["shardrun"] > 0 {
			worst = min(worst, v/c.Points[i-1].MedianTasksPerS["shardrun"])
		}
		best = max(best, v)
		if pg, ok := pt.PagesPerClaimedTask["shardrun"]; ok {
			pagesAt = append(pagesAt, pg)
			pageParts = append(pageParts, fmt.Sprintf("%d: %.1f", pt.Processes, pg))
		}
	}
	rise.Measured = fmt.Sprintf("tasks/s by processes %s; smallest step ratio %.2f", strings.Join(parts, ", "), worst)
	rise.Status = verdict(worst >= 1)
	end := c.Points[len(c.Points)-1]
	if best > 0 {
		ratio := end.MedianTasksPerS["shardrun"] / best
		last.Measure = fmt.Sprintf("scale curve, %d processes ÷ best point", end.Processes)
		last.Measured = fmt.Sprintf("%.2f (%.0f of %.0f tasks/s)", ratio, end.MedianTasksPerS["shardrun"], best)
		last.Status = verdict(ratio >= 0.9)
	}
	if len(pagesAt) > 0 {
		spread := slices.Max(pagesAt) / slices.Min(pagesAt)
		pages.Measured = fmt.Sprintf("by processes %s; largest ÷ smallest %.2f", strings.Join(pageParts, ", "), spread)
		pages.Status = verdict(spread <= 2)
	}
	return []target{rise, last, pages}
}

// costTargets compare the throughput section's medians of PostgreSQL CPU,
// statements and WAL per task with River's.
func costTargets(runs []burnDown) []target {
	byProcs := func(procs int, system string, f func(burnDown) float64) (float64, bool) {
		var xs []float64
		for _, r := range runs {
			if r.Processes == procs && r.System == system {
				xs = append(xs, f(r))
			}
		}
		return median(xs), len(xs) > 0
	}
	cpu := target{Measure: "PostgreSQL CPU per 10,000 tasks, 3 processes, shardrun ÷ River", Target: "≤ 0.7", Status: notMeasured}
	ours, okO := byProcs(3, "shardrun", func(r burnDown) float64 { return r.CPUPostgresPer10k })
	theirs, okT := byProcs(3, "river", func(r burnDown) float64 { return r.CPUPostgresPer10k })
	if okO && okT && theirs > 0 {
		cpu.Measured = fmt.Sprintf("%.2f (%.2f vs %.2f s, medians)", ours/theirs, ours, theirs)
		cpu.Status = verdict(ours <= 0.7*theirs)
	}
	out := []target{cpu}
	for _, m := range []struct {
		what, unit string
		f          func(burnDown) float64
	}{
		{"statements per task", "%.4f", func(r burnDown) float64 { return r.StmtsPerTask }},
		{"WAL bytes per task", "%.0f", func(r burnDown) float64 { return r.WALBytesPerTask }},
	} {
		t := target{Measure: m.what + ", throughput trials, shardrun vs River", Target: "≤ River's at every process count", Status: notMeasured}
		var parts []string
		ok := true
		for _, procs := range tuning.procs {
			ours, okO := byProcs(procs, "shardrun", m.f)
			theirs, okT := byProcs(procs, "river", m.f)
			if !okO || !okT || ours == 0 || theirs == 0 {
				continue
			}
			parts = append(parts, fmt.Sprintf("%d process(es): "+m.unit+" vs "+m.unit, procs, ours, theirs))
			ok = ok && ours <= theirs
		}
		if len(parts) > 0 {
			t.Measured, t.Status = strings.Join(parts, "; ")+" (medians)", verdict(ok)
		}
		out = append(out, t)
	}
	return out
}

// steadyTargets: at 5,000 tasks/s, p99 enqueue-to-start at most 10 ms
// batched and 20 ms single-row, and below River's.
func steadyTargets(runs []steadyRun) []target {
	var out []target
	for _, m := range []struct {
		mode  string
		limit float64
	}{{"batched", 10}, {"single", 20}} {
		t := target{Measure: fmt.Sprintf("steady 5,000 tasks/s, %s inserts, p99 enqueue→start", m.mode),
			Target: fmt.Sprintf("≤ %.0f ms and below River's", m.limit), Status: notMeasured}
		var ours, theirs *steadyRun
		for i, r := range runs {
			if r.Rate != 5000 || r.Mode != m.mode {
				continue
			}
			switch r.System {
			case "shardrun":
				ours = &runs[i]
			case "river":
				theirs = &runs[i]
			}
		}
		if ours != nil && theirs != nil {
			t.Measured = fmt.Sprintf("shardrun %.1f ms, River %.1f ms", ours.P99MS, theirs.P99MS)
			t.Status = verdict(ours.P99MS <= m.limit && ours.P99MS < theirs.P99MS && ours.NotStarted == 0)
			if ours.NotStarted > 0 {
				t.Measured += fmt.Sprintf(" (%d tasks not started)", ours.NotStarted)
			}
		}
		out = append(out, t)
	}
	return out
}

// unclaimableTargets: noop throughput with the unhandled tasks within 10%
// of the same run without them, in each setup of the section.
func unclaimableTargets(u *unclaimable) []target {
	if u == nil {
		return []target{{Measure: "200,000 ready tasks of an unhandled kind", Target: "noop throughput ≥ 0.9 × the same run without them", Status: notMeasured}}
	}
	var out []target
	for _, v := range u.Variants {
		out = append(out, target{Measure: fmt.Sprintf("%s ready tasks of an unhandled kind, %s", fmtThousands(u.Unhandled), v.Name),
			Target:   "noop throughput ≥ 0.9 × the same run without them",
			Measured: fmt.Sprintf("median ratio %.2f (trials %s)", v.MedianRatio, fmtList(v.Ratios)),
			Status:   verdict(v.MedianRatio >= 0.9)})
	}
	return out
}

// printTargets writes the targets table.
func printTargets(w io.Writer, ts []target) {
	fmt.Fprintln(w, "\n| target (issues 23, 26, 31, 35, 39, 40) | wanted | measured | result |\n| --- | --- | --- | --- |")
	for _, t := range ts {
		fmt.Fprintf(w, "| %s | %s | %s | **%s** |\n", t.Measure, t.Target, cmp.Or(t.Measured, "-"), t.Status)
	}
}
