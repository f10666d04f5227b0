package main

// The scale curve: noop burn-downs of both systems at 1 to 16 worker
// processes on one server and one shard count, drawn as a chart.

import (
	"context"
	"encoding/json"
	"fmt"
	"image/color"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// curveOpts are the scale curve's flags.
type curveOpts struct {
	procs   string
	trials  int
	workers int
	conns   int
}

// The defaults: 16 processes at 8 connections each are 128 of the bench
// server's max_connections of 300 (pgtmp's), leaving room for the bench's
// own; 512 workers per process is what shardrun's three-process
// throughput runs use, and River then fetches up to 512 per client too.
var curveFlags = curveOpts{procs: "1,2,4,8,16", trials: 3, workers: 512, conns: 8}

// curveShards is the shard count of every point (shardrun's default).
const curveShards = 256

// curvePoint is one process count's trials of both systems.
type curvePoint struct {
	Processes int `json:"processes"`
	// TasksPerS per trial, and their median, by system.
	TasksPerS       map[string][]float64 `json:"tasks_per_s"`
	MedianTasksPerS map[string]float64   `json:"median_tasks_per_s"`
	// Medians of the per-trial costs, by system.
	PagesPerClaimedTask map[string]float64 `json:"median_pg_pages_per_claimed_task,omitempty"`
	PagesPerTask        map[string]float64 `json:"median_pg_pages_per_task,omitempty"`
	WALBytesPerTask     map[string]float64 `json:"median_wal_bytes_per_task"`
	CPUPostgresPer10k   map[string]float64 `json:"median_cpu_s_per_10k_tasks_postgres"`
	StmtsPerTask        map[string]float64 `json:"median_pg_statements_per_task,omitempty"`
}

// curveResult is the scale curve section's report.
type curveResult struct {
	What       string       `json:"what"`
	Tasks      int          `json:"tasks_per_trial"`
	Shards     int          `json:"shard_count"`
	MaxWorkers int          `json:"max_workers_per_process"`
	DBConns    int          `json:"db_connections_per_process"`
	Points     []curvePoint `json:"points"`
	Chart      string       `json:"chart,omitempty"`
	Trials     []burnDown   `json:"trials"`
}

func (e *env) curveSection(ctx context.Context, rep *Report, n int, out string) error {
	procs, err := parseInts(curveFlags.procs)
	if err != nil {
		return fmt.Errorf("-curve-procs: %w", err)
	}
	rs := riverBase(curveFlags.workers)
	rs.PoolConns = int32(curveFlags.conns)
	res := &curveResult{
		What: fmt.Sprintf("noop burn-down of %d tasks at each process count, both systems on one PostgreSQL server, %d shards for shardrun; "+
			"%d workers and %d PostgreSQL connections per process for both (shardrun --max-workers and --db-max-conns, River MaxWorkers and "+
			"its pool), River's fetch settings as in the throughput section; each trial in a fresh database, the tasks inserted before the "+
			"workers start; trials of the two systems alternate", n, curveShards, curveFlags.workers, curveFlags.conns),
		Tasks: n, Shards: curveShards, MaxWorkers: curveFlags.workers, DBConns: curveFlags.conns,
	}
	rep.Curve = res
	for _, p := range procs {
		point := curvePoint{Processes: p, TasksPerS: map[string][]float64{}, MedianTasksPerS: map[string]float64{}}
		var trials []burnDown
		for trial := range curveFlags.trials {
			o := trialOpts{label: "curve", trial: trial, processes: p, n: n, maxWorkers: curveFlags.workers, dbMaxConns: curveFlags.conns}
			ours, err := e.shardrunBurnDown(ctx, o)
			if err != nil {
				return fmt.Errorf("shardrun, %d processes: %w", p, err)
			}
			trials = append(trials, ours)
			line := fmt.Sprintf("  %2d process(es), trial %d: shardrun %.0f tasks/s (%.1f pages per claimed task)", p, trial+1, ours.TasksPerS, ours.PagesPerClaimedTask)
			if tuning.withRiver {
				theirs, err := e.riverBurnDown(ctx, o, rs)
				if err != nil {
					return fmt.Errorf("river, %d processes: %w", p, err)
				}
				trials = append(trials, theirs)
				line += fmt.Sprintf(", river %.0f jobs/s (%.1f)", theirs.TasksPerS, theirs.PagesPerClaimedTask)
			}
			fmt.Fprintln(e.log, line)
		}
		for _, t := range trials {
			point.TasksPerS[t.System] = append(point.TasksPerS[t.System], t.TasksPerS)
		}
		for system, xs := range point.TasksPerS {
			point.MedianTasksPerS[system] = median(xs)
		}
		point.PagesPerClaimedTask = medianBy(trials, func(t burnDown) float64 { return t.PagesPerClaimedTask })
		point.PagesPerTask = medianBy(trials, func(t burnDown) float64 { return t.PagesPerTask })
		point.WALBytesPerTask = medianBy(trials, func(t burnDown) float64 { return t.WALBytesPerTask })
		point.CPUPostgresPer10k = medianBy(trials, func(t burnDown) float64 { return t.CPUPostgresPer10k })
		point.StmtsPerTask = medianBy(trials, func(t burnDown) float64 { return t.StmtsPerTask })
		res.Points = append(res.Points, point)
		res.Trials = append(res.Trials, trials...)
	}
	chart := filepath.Join(filepath.Dir(out), "scale.svg")
	if err := writeCurveChart(res, chart); err != nil {
		return err
	}
	res.Chart = chart
	fmt.Fprintf(e.log, "  wrote %s\n", chart)
	return nil
}

// medianBy is the median of f over each system's trials; systems whose
// values are all 0 (not measured) are left out.
func medianBy(trials []burnDown, f func(burnDown) float64) map[string]float64 {
	by := map[string][]float64{}
	for _, t := range trials {
		by[t.System] = append(by[t.System], f(t))
	}
	out := map[string]float64{}
	for system, xs := range by {
		if m := median(xs); m != 0 {
			out[system] = m
		}
	}
	return out
}

func parseInts(list string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(list, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("bad count %q", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// curveColors are the systems' colours in the chart.
var curveColors = map[string]color.Color{
	"shardrun": color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	"river":    color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
}

// writeCurveChart draws tasks/s against processes, one line per system
// through the medians and every trial as a faint dot, to path (SVG).
func writeCurveChart(res *curveResult, path string) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("noop burn-down of %s tasks, %d shards, %d workers per process", fmtThousands(res.Tasks), res.Shards, res.MaxWorkers)
	p.X.Label.Text = "worker processes"
	p.Y.Label.Text = "tasks/s (line: median of the trials)"
	p.X.Scale = plot.LogScale{}
	var ticks []plot.Tick
	for _, pt := range res.Points {
		ticks = append(ticks, plot.Tick{Value: float64(pt.Processes), Label: strconv.Itoa(pt.Processes)})
	}
	p.X.Tick.Marker = plot.ConstantTicks(ticks)
	// From 0, with headroom above the highest trial for the legend.
	p.Y.Min = 0
	for _, pt := range res.Points {
		for _, xs := range pt.TasksPerS {
			for _, v := range xs {
				p.Y.Max = max(p.Y.Max, 1.25*v)
			}
		}
	}
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())
	for _, system := range []string{"shardrun", "river"} {
		var line, dots plotter.XYs
		for _, pt := range res.Points {
			if m, ok := pt.MedianTasksPerS[system]; ok {
				line = append(line, plotter.XY{X: float64(pt.Processes), Y: m})
			}
			for _, v := range pt.TasksPerS[system] {
				dots = append(dots, plotter.XY{X: float64(pt.Processes), Y: v})
			}
		}
		if len(line) == 0 {
			continue
		}
		l, pts, err := plotter.NewLinePoints(line)
		if err != nil {
			return fmt.Errorf("charting %s: %w", system, err)
		}
		l.Color, l.Width = curveColors[system], vg.Points(2)
		pts.Color, pts.Shape = curveColors[system], draw.CircleGlyph{}
		s, err := plotter.NewScatter(dots)
		if err != nil {
			return fmt.Errorf("charting %s: %w", system, err)
		}
		faint := color.RGBAModel.Convert(curveColors[system]).(color.RGBA)
		faint.A = 0x70
		s.Color, s.Radius = faint, vg.Points(2)
		p.Add(l, pts, s)
		p.Legend.Add(system, l, pts)
	}
	if err := p.Save(7*vg.Inch, 4.5*vg.Inch, path); err != nil {
		return fmt.Errorf("writing the chart %s: %w", path, err)
	}
	return nil
}

// printCurve adds the scale curve's rows.
func printCurve(w io.Writer, c *curveResult) {
	for _, pt := range c.Points {
		fmt.Fprintf(w, "| scale curve, %d process(es), %d shards, %s noop tasks | shardrun %.0f tasks/s, River %.0f jobs/s (medians); pages per claimed task %.1f vs %.1f; WAL bytes per task %.0f vs %.0f |\n",
			pt.Processes, c.Shards, fmtThousands(c.Tasks), pt.MedianTasksPerS["shardrun"], pt.MedianTasksPerS["river"],
			pt.PagesPerClaimedTask["shardrun"], pt.PagesPerClaimedTask["river"], pt.WALBytesPerTask["shardrun"], pt.WALBytesPerTask["river"])
	}
	if c.Chart != "" {
		fmt.Fprintf(w, "| scale curve chart | %s |\n", c.Chart)
	}
}

// redrawChart draws the scale curve of the report at from next to out.
func redrawChart(from, out string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	var rep Report
	if err := json.Unmarshal(b, &rep); err != nil {
		return fmt.Errorf("reading %s: %w", from, err)
	}
	if rep.Curve == nil {
		return fmt.Errorf("%s has no scale curve (section curve)", from)
	}
	chart := filepath.Join(filepath.Dir(out), "scale.svg")
	if err := writeCurveChart(rep.Curve, chart); err != nil {
		return err
	}
	fmt.Println("wrote", chart)
	return nil
}
