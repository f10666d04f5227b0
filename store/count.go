package store

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// Bounds of CountMatching.
const (
	// MatchCountCap is where CountMatching stops counting: an operator
	// deciding whether to cancel or retry needs to know "a few", "this
	// many" or "more than ten thousand", not the exact size of a backlog.
	MatchCountCap = 10_000
	// MatchCountScan bounds the candidate rows one count examines when
	// part of the filter is applied to fetched rows: ten listing
	// statements' worth (ListScan; about 0.8s on two cores against 10
	// million rows by that measurement, not measured for the count
	// itself), so that a filter matching few of many candidates cannot
	// make one count read the whole table.
	MatchCountScan = 10 * ListScan
)

// MatchCount is the answer of CountMatching. Count is exact unless AtLeast
// is set; then at least Count tasks match, and Examined says why the count
// stopped: it reached MatchCountCap, or it examined MatchCountScan
// candidates (the newest, by id) without reaching the end.
type MatchCount struct {
	Count   int64 `json:"count"`
	AtLeast bool  `json:"at_least,omitempty"`
	// Examined is how many candidate tasks the count read, when it stopped
	// for that reason (AtLeast with Count below the cap).
	Examined int64 `json:"examined,omitempty"`
}

// CountMatching counts the tasks matching f up to MatchCountCap, reading
// at most MatchCountScan candidates of the filter's driving index (see
// stream), newest first: the count an operator sees before a bulk
// operation, and beside a listing. Its cost is bounded whatever the
// table's size and the filter.
func (s *Store) CountMatching(ctx context.Context, f tasks.Filter) (MatchCount, error) {
	sql, args, scan := countQuery(f)
	var mc MatchCount
	var examined int64
	err := pgx.BeginTxFunc(ctx, s.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, sql, args...).Scan(&mc.Count, &examined)
	})
	if err != nil {
		return MatchCount{}, fmt.Errorf("counting the tasks that match a filter: %w", err)
	}
	switch {
	case mc.Count >= MatchCountCap:
		mc.Count, mc.AtLeast = MatchCountCap, true
	case examined >= int64(scan):
		// The stream had more candidates than the count read.
		mc.AtLeast, mc.Examined = true, examined
	}
	return mc, nil
}

// CountQuery returns the statement and arguments of CountMatching: the
// plans test explains it.
func CountQuery(f tasks.Filter) (string, []any) {
	sql, args, _ := countQuery(f)
	return sql, args
}

// countQuery is the statement of CountMatching, answering the count and
// how many candidates were examined, and the scan bound it used. A filter
// its driving index answers whole (rest empty) is counted on the index
// alone, up to the cap; otherwise the stream's candidates are fetched by
// primary key and filtered by the rest.
func countQuery(f tasks.Filter) (sql string, args []any, scan int) {
	others := f
	others.States = nil
	if len(f.States) > 0 && others.Empty() {
		// States alone are counted in each state's own places, as
		// CountByStateCapped does: ready tasks have no index in id order
		// that a stream could walk, but task_ready and task_waiting hold
		// them all.
		var b sqlBuilder
		states := slices.Compact(slices.Sorted(slices.Values(f.States)))
		parts := make([]string, 0, len(states))
		for _, st := range states {
			var from string
			switch st {
			case tasks.Ready:
				parts = append(parts, "(SELECT count(*) FROM (SELECT 1 FROM task_waiting WHERE NOT ended LIMIT "+strconv.Itoa(MatchCountCap)+") x)")
				from = "task_ready"
			case tasks.Running:
				from = "task_claims"
			default:
				from = "task_finished f WHERE f.state = ANY (ARRAY[" + b.arg(string(st)) + "::text]) ORDER BY f.state, f.id"
			}
			parts = append(parts, "(SELECT count(*) FROM (SELECT 1 FROM "+from+" LIMIT "+strconv.Itoa(MatchCountCap)+") x)")
		}
		sum := "(" + strings.Join(parts, " + ") + ")"
		return `/* shardrun.count_matching_states */ SELECT ` + sum + `, 0`, b.args, MatchCountCap + 1
	}
	var probe sqlBuilder
	_, rest := probe.stream(f, 0, true, 1)
	var b sqlBuilder
	if rest == "" {
		stream, _ := b.stream(f, 0, true, MatchCountCap)
		return `/* shardrun.count_matching */ SELECT count(*), count(*) FROM (` + stream + `) c`, b.args, MatchCountCap + 1
	}
	stream, rest := b.stream(f, 0, true, MatchCountScan)
	return `/* shardrun.count_matching */
		WITH c AS MATERIALIZED (` + stream + `)
		SELECT (SELECT count(*) FROM (SELECT 1 FROM (` + byID("SELECT id FROM c", " DESC") + `) t WHERE ` + rest + ` LIMIT ` +
		strconv.Itoa(MatchCountCap) + `) m), (SELECT count(*) FROM c)`, b.args, MatchCountScan
}
