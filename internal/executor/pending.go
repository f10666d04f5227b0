package executor

import (
	"slices"
	"sync"

	"github.com/shardrun/shardrun/internal/claims"
	"github.com/shardrun/shardrun/tasks"
)

// pending tracks which held shards may have due tasks, and the order the
// next claim visits them in. A claim reads the lanes of the shards it is
// given until it has enough tasks, so telling it only the shards that may
// have work keeps an idle or nearly drained runner from reading every
// empty lane of every shard it owns, and rotating the order keeps one
// shard's backlog from starving the others.
//
// A shard becomes pending when it is first held, when an enqueue
// notification names it, and at every poll interval when the claimer's
// probe finds its queue's tasks there (tasks that come due by their
// run_after, and inserts whose notification was lost, notify nobody: the
// probe reads them all, due or not); it stops being pending when a claim
// finds no more of its tasks due. Notifications arrive from the listener's
// goroutine; everything else belongs to the claim loop.
//
// A probed pending set (a runner serving many queues: claimer.go, prober)
// is told exactly which shards have its queue's tasks, by notify after
// each probe: it marks no shard on its own, not even when first held.
type pending struct {
	mu     sync.Mutex
	woken  map[int]bool
	all    bool
	urgent map[int]bool

	shards map[int]bool
	known  map[int]bool
	// first are the pending shards that got urgent tasks: the next claim
	// visits them before the rotation.
	first map[int]bool
	// next is, by part (partOf; part 0 without it), the shard the next
	// claim starts from in that part, nextUrgent the same for the next
	// claim of urgent tasks: both rotate, so that no shard's backlog
	// starves the others. Each part keeps its own position because a claim
	// split between parts visits each part's shards on its own, filling
	// its share from the first shards of the part it reaches: one position
	// for the whole order, set after the part whose claim went furthest,
	// made every other part start again from the same few shards of it
	// while they had a backlog, and a shard after them (one moved in, with
	// its copied backlog) waited until they drained (bench section
	// databases: a moved shard's copied backlog started 15.8-27.5 s after
	// the move).
	next, nextUrgent map[int]int
	// probed: shards are marked by notify only (see above).
	probed bool
	// partOf, when set, names the part of the store each shard's claims go
	// to (a database of several, PartOf): a claim visits each part's
	// shards in order on its own, so what it drained is judged per part.
	partOf func(shard int) int
}

func newPending(probed bool) *pending {
	return &pending{woken: map[int]bool{}, urgent: map[int]bool{}, shards: map[int]bool{}, known: map[int]bool{},
		first: map[int]bool{}, probed: probed, next: map[int]int{}, nextUrgent: map[int]int{}}
}

// notify records an enqueue notification (all: every shard; urgent: the
// shards that got tasks more urgent than the default).
func (p *pending) notify(all bool, shards, urgent []int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.all = p.all || all
	for _, s := range shards {
		p.woken[s] = true
	}
	for _, s := range urgent {
		p.woken[s], p.urgent[s] = true, true
	}
}

// order returns the held terms that may have due tasks, from the
// rotation's position, and, of those, the ones that got urgent tasks
// (first, from the urgent rotation's position), which the claim loop sends
// a claim of urgent tasks only before the rotation's claim. terms are the
// held terms, ordered by shard.
func (p *pending) order(terms []claims.ShardEpoch) (first, order []claims.ShardEpoch) {
	p.mu.Lock()
	all, woken, urgent := p.all, p.woken, p.urgent
	p.all, p.woken, p.urgent = false, map[int]bool{}, map[int]bool{}
	p.mu.Unlock()
	for s := range urgent {
		p.first[s] = true
	}
	held := make(map[int]bool, len(terms))
	for _, t := range terms {
		held[t.Shard] = true
		if all || woken[t.Shard] || (!p.probed && !p.known[t.Shard]) {
			p.shards[t.Shard] = true
		}
	}
	p.known = held
	for s := range p.shards {
		if !held[s] {
			delete(p.shards, s)
		}
	}
	for s := range p.first {
		if !p.shards[s] {
			delete(p.first, s)
		}
	}
	return p.rotate(terms, p.nextUrgent, p.first), p.rotate(terms, p.next, p.shards)
}

// part is the part of shard (0 without partOf).
func (p *pending) part(shard int) int {
	if p.partOf == nil {
		return 0
	}
	return p.partOf(shard)
}

// rotate returns the terms whose shard is in set, each part's (partOf)
// starting from the first shard of the part at or after the part's
// position in from and wrapping around within the part, the parts one
// after another in the order of their first shard. terms are ordered by
// shard.
func (p *pending) rotate(terms []claims.ShardEpoch, from map[int]int, set map[int]bool) []claims.ShardEpoch {
	if len(set) == 0 {
		return nil
	}
	var parts []int
	byPart := map[int][]claims.ShardEpoch{}
	for _, t := range terms {
		k := p.part(t.Shard)
		if _, ok := byPart[k]; !ok {
			parts = append(parts, k)
		}
		byPart[k] = append(byPart[k], t)
	}
	out := make([]claims.ShardEpoch, 0, len(set))
	for _, k := range parts {
		ts := byPart[k]
		start, _ := slices.BinarySearchFunc(ts, from[k], func(t claims.ShardEpoch, s int) int { return t.Shard - s })
		for i := range ts {
			if t := ts[(start+i)%len(ts)]; set[t.Shard] {
				out = append(out, t)
			}
		}
	}
	return out
}

// visited reads what a claim over order took (got, with limit): by part,
// the index in order of the last shard it took from in that part — or,
// when it did not fill its limit, of the part's last shard in order: the
// part's next claim starts after it — and the shards it drained of what it
// claims: those before that last one, and every one when the claim took
// fewer than limit (it visited every shard and found no more).
//
// A claim split between parts (partOf: a router over several databases
// asks each database for a share of the limit, over its own shards) visits
// each part's shards on its own: a full claim drained the shards of a
// part before the last one it took from in that part, and nothing of a
// part it took nothing from (it may not have been asked). Judged over the
// whole order, a full claim marked a database's shards drained because
// another database's claim went further (bench section databases: one
// database of two at a fifth of its quota with its backlog untouched).
func visited(order []claims.ShardEpoch, got []tasks.Task, limit int, partOf func(int) int) (lastIn map[int]int, drained []claims.ShardEpoch) {
	if partOf == nil {
		partOf = func(int) int { return 0 }
	}
	lastIn = map[int]int{}
	if len(got) < limit {
		for i, se := range order {
			lastIn[partOf(se.Shard)] = i
		}
		return lastIn, order
	}
	from := make(map[int]bool, len(got))
	for _, t := range got {
		from[t.Shard] = true
	}
	for i, se := range order {
		if from[se.Shard] {
			lastIn[partOf(se.Shard)] = i
		}
	}
	for i, se := range order {
		if l, ok := lastIn[partOf(se.Shard)]; ok && i < l {
			drained = append(drained, se)
		}
	}
	return lastIn, drained
}

// urgentClaimed records what a claim of urgent tasks over first took: the
// shards it drained have no urgent tasks left, and the next claim of
// urgent tasks starts after the last shard it visited.
func (p *pending) urgentClaimed(first []claims.ShardEpoch, got []tasks.Task, limit int) {
	if len(first) == 0 {
		return
	}
	lastIn, drained := visited(first, got, limit, p.partOf)
	for _, t := range drained {
		delete(p.first, t.Shard)
	}
	for k, i := range lastIn {
		p.nextUrgent[k] = first[i].Shard + 1
	}
}

// claimed records what a claim over order took: the claim visits the
// shards in order and moves to the next one only when a shard has no more
// due tasks, so the shards it drained (visited) are no longer pending.
// The next claim starts after the last shard visited.
func (p *pending) claimed(order []claims.ShardEpoch, got []tasks.Task, limit int) {
	if len(order) == 0 {
		return
	}
	lastIn, drained := visited(order, got, limit, p.partOf)
	for _, t := range drained {
		delete(p.shards, t.Shard)
		delete(p.first, t.Shard)
	}
	for k, i := range lastIn {
		p.next[k] = order[i].Shard + 1
	}
}

// covers reports whether the next order will include shard, if held:
// it is pending, notified or (unprobed) newly held.
func (p *pending) covers(shard int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shards[shard] || p.all || p.woken[shard] || (!p.probed && !p.known[shard])
}

// any reports whether some held shard may have due tasks.
func (p *pending) any() bool { return len(p.shards) > 0 }

// quiet reports whether a probed pending set has nothing to claim and was
// told of nothing since: order would return nothing, and need not be
// called.
func (p *pending) quiet() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.probed && !p.all && len(p.woken) == 0 && len(p.shards) == 0 && len(p.first) == 0
}
