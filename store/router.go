package store

// The router: the named stores of a cluster of several databases and the
// shard → database map, routing every statement by its shard
// (docs/architecture.md, "Several databases"). router_exec.go holds the
// executor's statements, router_tasks.go the producers' and operators',
// router_leader.go the leader's.
//
// With one database every method calls its store directly: no goroutine,
// no copy, no statement more than the store's own (the fast path).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/clock"
)

// Map is the shard → database map.
type Map struct {
	// Rev is the etcd ModRevision of meta/databases; 0: the implicit map
	// of a cluster created before several databases (every shard in
	// "main"), or one read from the databases (ReadMap) that recorded no
	// revision.
	Rev int64
	// Databases are the databases in creation order; a database's slot is
	// its index.
	Databases []string
	// Shards[s] names shard s's database.
	Shards []string
	// Moves are the moves under way.
	Moves []Move
}

// Move is a shard's move between databases under way: its phase is the
// move driver's ("leaving", "switched", …).
type Move struct {
	Shard    int
	From, To string
	Phase    string
}

// NewMap spreads shardCount shards over databases in contiguous ranges, in
// order: the first len(databases) - shardCount%len(databases) databases
// get ⌊shardCount/n⌋ shards, the rest one more.
func NewMap(databases []string, shardCount int) Map {
	m := Map{Databases: slices.Clone(databases), Shards: make([]string, shardCount)}
	n := len(databases)
	if n == 0 {
		return m
	}
	base, extra := shardCount/n, shardCount%n
	s := 0
	for i, name := range databases {
		size := base
		if i >= n-extra {
			size++
		}
		for range size {
			m.Shards[s] = name
			s++
		}
	}
	return m
}

// Slot is db's index in the map's databases, -1 when the map does not
// name it.
func (m Map) Slot(db string) int { return slices.Index(m.Databases, db) }

// ShardsOf lists the shards the map gives db, in order.
func (m Map) ShardsOf(db string) []int {
	var out []int
	for s, name := range m.Shards {
		if name == db {
			out = append(out, s)
		}
	}
	return out
}

// Ranges is db's shards as ranges, "0-127,200" (empty: none), for
// /api/databases.
func (m Map) Ranges(db string) string {
	var parts []string
	shards := m.ShardsOf(db)
	for i := 0; i < len(shards); {
		j := i
		for j+1 < len(shards) && shards[j+1] == shards[j]+1 {
			j++
		}
		if j == i {
			parts = append(parts, strconv.Itoa(shards[i]))
		} else {
			parts = append(parts, strconv.Itoa(shards[i])+"-"+strconv.Itoa(shards[j]))
		}
		i = j + 1
	}
	return strings.Join(parts, ",")
}

// Check reports a map that names no database, a database twice, more
// than MaxDatabases, or a shard in a database it does not list.
func (m Map) Check() error {
	switch {
	case len(m.Databases) == 0:
		return errors.New("the map names no database")
	case len(m.Databases) > MaxDatabases:
		return fmt.Errorf("the map names %d databases, at most %d", len(m.Databases), MaxDatabases)
	case len(m.Shards) == 0:
		return errors.New("the map places no shard")
	}
	for i, name := range m.Databases {
		if name == "" || slices.Contains(m.Databases[:i], name) {
			return fmt.Errorf("the map names database %q twice, or a database without a name", name)
		}
	}
	for s, name := range m.Shards {
		if !slices.Contains(m.Databases, name) {
			return fmt.Errorf("the map places shard %d in database %q, which it does not list", s, name)
		}
	}
	return nil
}

// ErrWrongDatabase: a producer's transaction is on another database than
// the task's shard (EnqueueIn, EnqueueBatchIn), or a batch given one
// transaction spans several databases.
var ErrWrongDatabase = errors.New("store: the transaction is on another database than the task's shard")

// staleRetries bounds how often an enqueue refused with SR001 (the map
// was stale) re-reads the map and tries again.
const staleRetries = 3

// Router routes every statement by its shard to the database that holds
// the shard: the named stores of a cluster and its shard → database map.
// It implements the executor's Store (each method splits its refs or
// terms by database and merges the answers in the caller's order), and
// offers what internal/client.Tasks, the coordinator and the leader need:
// enqueue (a batch split by database, one transaction each), reads merged
// across databases (listings in id order, counts summed, queues merged),
// operations by the task's database, and the leader's passes per
// database.
//
// A database that is down does not stop the others: its writes are
// answered claims.Busy (written again later), nothing is claimed there,
// its fences are left to raise later (claims.Orphans.Unreached); after a
// failure that says the database is unreachable the router skips it,
// answering at once, until a background ping reaches it again.
//
// With one database every method calls its store directly.
type Router struct {
	log    hclog.Logger
	stores map[string]*Store
	// names are the map's databases in order (fixed: the databases are
	// fixed when the cluster is created).
	names []string
	// one is the only store of a cluster of one database: the fast path.
	one *Store
	cur atomic.Pointer[routing]
	// claims counts claims, to rotate which database a claim asks first.
	claims atomic.Uint64

	// OnStale reads the current map after a database refused an insert
	// into a shard it does not hold (SQLSTATE SR001): the router's map was
	// stale. Set it before the router is used; nil reads the map from the
	// databases' placement rows (ReadMap), as a producer without etcd does.
	OnStale func(ctx context.Context) (Map, error)
	// refreshing serialises OnStale calls: producers refused together
	// read the map once.
	refreshing sync.Mutex

	health map[string]*health
	// conns caches the database of each connection a producer's
	// transaction ran on (databaseOf), keyed weakly.
	conns sync.Map
	// probes run the pings of databases marked down; Close ends them.
	probeCtx    context.Context
	stopProbes  context.CancelFunc
	probesGroup sync.WaitGroup
	closed      atomic.Bool
}

// routing is one map and each shard's store under it.
type routing struct {
	m  Map
	of []*Store
}

// NewRouter returns a router over stores under the map m. Every name of
// the map must have a store and every store a name in the map, else an
// error naming the database. The router does not own the stores until
// Close, which closes them.
func NewRouter(stores map[string]*Store, m Map, log hclog.Logger) (*Router, error) {
	if err := m.Check(); err != nil {
		return nil, fmt.Errorf("routing by the map of databases (revision %d): %w", m.Rev, err)
	}
	for _, name := range m.Databases {
		if stores[name] == nil {
			return nil, fmt.Errorf("the map of databases (revision %d) names database %s, which this process was not given", m.Rev, name)
		}
	}
	for _, name := range slices.Sorted(mapKeys(stores)) {
		if !slices.Contains(m.Databases, name) {
			return nil, fmt.Errorf("database %s is not in the map of databases (revision %d: %s); the databases are fixed when the cluster is created",
				name, m.Rev, strings.Join(m.Databases, ", "))
		}
	}
	r := &Router{log: cmp.Or(log, hclog.NewNullLogger()), stores: stores, names: slices.Clone(m.Databases),
		health: make(map[string]*health, len(stores))}
	if len(stores) == 1 {
		r.one = stores[m.Databases[0]]
	}
	for name := range stores {
		r.health[name] = &health{backoff: clock.Backoff{Min: probeMin, Max: probeMax}}
	}
	r.probeCtx, r.stopProbes = context.WithCancel(context.Background())
	r.cur.Store(newRouting(m, stores))
	return r, nil
}

func mapKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func newRouting(m Map, stores map[string]*Store) *routing {
	rt := &routing{m: m, of: make([]*Store, len(m.Shards))}
	for s, name := range m.Shards {
		rt.of[s] = stores[name]
	}
	return rt
}

// SetMap routes by m from now on when it is newer than the current map
// (a larger revision; an older or equal one is ignored), as etcd's watch
// of meta/databases delivers it. A map that names other databases than
// the router's, or fails Check, is ignored and logged: the databases are
// fixed when the cluster is created.
func (r *Router) SetMap(m Map) {
	for {
		cur := r.cur.Load()
		if m.Rev <= cur.m.Rev && !(m.Rev == 0 && cur.m.Rev == 0) {
			return
		}
		if err := m.Check(); err != nil {
			r.log.Error("ignoring a map of databases", "revision", m.Rev, "error", err)
			return
		}
		if !slices.Equal(m.Databases, r.names) {
			r.log.Error("ignoring a map of databases that names other databases", "revision", m.Rev,
				"databases", strings.Join(m.Databases, ","), "known", strings.Join(r.names, ","))
			return
		}
		if len(m.Shards) != len(cur.m.Shards) {
			r.log.Error("ignoring a map of databases of another shard count", "revision", m.Rev, "shards", len(m.Shards), "known", len(cur.m.Shards))
			return
		}
		if r.cur.CompareAndSwap(cur, newRouting(m, r.stores)) {
			return
		}
	}
}

// Map returns the current map.
func (r *Router) Map() Map { return r.cur.Load().m }

// Store returns the store of the database name (nil: none).
func (r *Router) Store(name string) *Store { return r.stores[name] }

// Names lists the databases in the map's order.
func (r *Router) Names() []string { return slices.Clone(r.names) }

// Catalog is the store of the first database, which holds the schedules.
func (r *Router) Catalog() *Store { return r.stores[r.names[0]] }

// Of returns the database of shard and its store ("" and nil for a shard
// outside the map).
func (r *Router) Of(shard int) (name string, st *Store) {
	rt := r.cur.Load()
	if shard < 0 || shard >= len(rt.of) {
		return "", nil
	}
	return rt.m.Shards[shard], rt.of[shard]
}

// Each runs f for every database, concurrently, and returns their errors
// joined, each naming its database.
func (r *Router) Each(ctx context.Context, f func(name string, st *Store) error) error {
	errs := make([]error, len(r.names))
	parallel(len(r.names), func(i int) {
		name := r.names[i]
		if err := f(name, r.stores[name]); err != nil {
			errs[i] = fmt.Errorf("database %s: %w", name, err)
		}
	})
	return errors.Join(errs...)
}

// Close stops the router's pings and closes every store.
func (r *Router) Close() {
	if !r.closed.CompareAndSwap(false, true) {
		return
	}
	r.stopProbes()
	r.probesGroup.Wait()
	for _, name := range r.names {
		r.stores[name].Close()
	}
}

// Register records each database's place in the cluster under the
// router's map (Store.Register: its name, its slot, the count, and the
// first time the shards the map gives it), every database at once.
func (r *Router) Register(ctx context.Context) error {
	m := r.Map()
	return r.Each(ctx, func(name string, st *Store) error {
		return st.Register(ctx, RegisterOpts{Name: name, Shards: m.ShardsOf(name), Databases: len(m.Databases), MapRev: m.Rev, Slot: m.Slot(name)})
	})
}

// ReadMap reads the map that a producer without etcd needs from the
// databases' placement rows (stores by name): each shard in the database
// that holds it; a shard no database holds (a move between its commit
// and its arrival) in the database it is leaving, else the one it went
// to, else the one it is arriving at. The databases are ordered by their
// slots; Rev is the largest map revision of the rows. A shard that no
// database knows is an error naming it.
func ReadMap(ctx context.Context, stores map[string]*Store) (Map, error) {
	type found struct {
		name  string
		mem   Membership
		place []ShardPlacement
		err   error
	}
	names := slices.Sorted(mapKeys(stores))
	res := make([]found, len(names))
	parallel(len(names), func(i int) {
		f := &res[i]
		f.name = names[i]
		st := stores[f.name]
		if f.mem, f.err = st.Membership(ctx); f.err != nil {
			return
		}
		f.place, f.err = st.Placement(ctx)
	})
	var errs []error
	for _, f := range res {
		if f.err != nil {
			errs = append(errs, fmt.Errorf("database %s: %w", f.name, f.err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return Map{}, fmt.Errorf("reading the map of databases from the databases: %w", err)
	}
	slices.SortFunc(res, func(a, b found) int { return cmp.Or(cmp.Compare(a.mem.Slot, b.mem.Slot), cmp.Compare(a.name, b.name)) })
	shardCount := 0
	m := Map{}
	for i, f := range res {
		if f.mem.Slot != i || !f.mem.Registered && len(res) > 1 {
			return Map{}, fmt.Errorf("reading the map of databases from the databases: database %s is registered as slot %d (registered: %v) among %d databases",
				f.name, f.mem.Slot, f.mem.Registered, len(res))
		}
		m.Databases = append(m.Databases, f.name)
		shardCount = max(shardCount, f.mem.ShardCount)
	}
	if shardCount == 0 {
		return Map{}, errors.New("reading the map of databases from the databases: no database recorded the shard count")
	}
	m.Shards = make([]string, shardCount)
	rank := map[string]int{PlacementHeld: 4, PlacementLeaving: 3, PlacementGone: 2, PlacementArriving: 1}
	best := make([]int, shardCount)
	for _, f := range res {
		for _, p := range f.place {
			if p.Shard >= shardCount {
				continue
			}
			m.Rev = max(m.Rev, p.MapRev)
			name := f.name
			if p.State == PlacementGone {
				name = p.Peer
			}
			if rank[p.State] > best[p.Shard] && name != "" {
				m.Shards[p.Shard], best[p.Shard] = name, rank[p.State]
			}
		}
	}
	for s, name := range m.Shards {
		if name == "" {
			return Map{}, fmt.Errorf("reading the map of databases from the databases: no database holds shard %d", s)
		}
	}
	return m, nil
}

// refresh reads the current map after a database refused an insert under
// the map of revision seen (OnStale, or ReadMap), unless a newer map
// arrived meanwhile.
func (r *Router) refresh(ctx context.Context, seen int64) error {
	r.refreshing.Lock()
	defer r.refreshing.Unlock()
	if r.cur.Load().m.Rev > seen {
		return nil
	}
	var m Map
	var err error
	if r.OnStale != nil {
		m, err = r.OnStale(ctx)
	} else {
		m, err = ReadMap(ctx, r.stores)
	}
	if err != nil {
		return fmt.Errorf("re-reading the map of databases (revision %d refused): %w", seen, err)
	}
	r.SetMap(m)
	return nil
}

// ---- which database a producer's transaction is on ----

// databaseOf returns the name of the database tx runs on, as the database
// records it (shardrun_cluster.db_name): read once per connection and
// cached by the connection, weakly (a closed connection's entry goes with
// it).
func (r *Router) databaseOf(ctx context.Context, tx pgx.Tx) (string, error) {
	conn := tx.Conn()
	if conn == nil {
		return "", errors.New("the transaction has no connection")
	}
	key := weak.Make(conn)
	if name, ok := r.conns.Load(key); ok {
		return name.(string), nil
	}
	var name string
	if err := tx.QueryRow(ctx, `/* shardrun.db_name */ SELECT db_name FROM shardrun_cluster WHERE id = 1`).Scan(&name); err != nil {
		return "", fmt.Errorf("reading which database the transaction is on: %w", err)
	}
	if _, loaded := r.conns.LoadOrStore(key, name); !loaded {
		runtime.AddCleanup(conn, func(k weak.Pointer[pgx.Conn]) { r.conns.Delete(k) }, key)
	}
	return name, nil
}

// ---- databases that are down ----

// Pacing of the pings of a database marked down.
const (
	probeMin     = 100 * time.Millisecond
	probeMax     = 5 * time.Second
	probeTimeout = 2 * time.Second
)

// health is what the router knows of one database's reachability.
type health struct {
	mu   sync.Mutex
	down bool
	// episode counts the times the database was marked down: a prober
	// ends when its episode is over (another ping reached the database).
	episode int
	since   time.Time
	lastErr error
	backoff clock.Backoff
}

// usable reports whether statements may be sent to database name now.
func (r *Router) usable(name string) bool {
	h := r.health[name]
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.down
}

// downError is the answer for a database marked down.
func (r *Router) downError(name string) error {
	h := r.health[name]
	h.mu.Lock()
	defer h.mu.Unlock()
	return &Error{Class: ErrUnavailable, Err: fmt.Errorf("database %s is unreachable since %s: %w",
		name, h.since.Format(time.RFC3339), h.lastErr)}
}

// observe records the outcome of a statement sent to database name: an
// error that says it could not be reached (not the caller's own context
// ending) marks it down until a ping reaches it again (probe).
func (r *Router) observe(ctx context.Context, name string, err error) {
	if err == nil || ctx.Err() != nil || !r.Unavailable(err) || r.closed.Load() {
		return
	}
	var pe interface{ SQLState() string }
	if errors.As(err, &pe) {
		return // the server answered: it is up (a lock timeout, a serialization failure)
	}
	h := r.health[name]
	h.mu.Lock()
	if h.down {
		h.mu.Unlock()
		return
	}
	h.down, h.since, h.lastErr = true, time.Now(), err
	h.episode++
	episode := h.episode
	h.backoff.Reset()
	h.mu.Unlock()
	r.log.Warn("database unreachable; its shards pause while the others go on", "database", name, "error", err)
	p := &prober{r: r, name: name, h: h, episode: episode}
	r.probesGroup.Go(func() { p.Run(r.probeCtx) })
}

// Reached records that database name answered a ping of someone else's
// (the process's health watcher, placement.Health): a database marked
// down is usable again at once, not at its prober's next ping, up to
// probeMax later. Without it the health the API shows and the router's
// could disagree: available, while enqueues were still refused.
func (r *Router) Reached(name string) {
	if h := r.health[name]; h != nil {
		r.reached(name, h, 0)
	}
}

// reached marks h up if it is down (in episode, when not 0) and logs it.
func (r *Router) reached(name string, h *health, episode int) {
	h.mu.Lock()
	if !h.down || (episode != 0 && episode != h.episode) {
		h.mu.Unlock()
		return
	}
	since := h.since
	h.down = false
	h.mu.Unlock()
	r.log.Info("database reachable again", "database", name, "down_for", time.Since(since).Round(time.Millisecond))
}

// prober pings a database marked down until it answers, then marks it up.
type prober struct {
	r       *Router
	name    string
	h       *health
	episode int
}

// over reports whether the prober's episode has ended: the database was
// reached meanwhile (Reached), and maybe marked down again since, with a
// prober of its own.
func (p *prober) over() bool {
	p.h.mu.Lock()
	defer p.h.mu.Unlock()
	return !p.h.down || p.h.episode != p.episode
}

// Run pings until the database answers, its episode is over, or ctx ends.
func (p *prober) Run(ctx context.Context) {
	for {
		p.h.mu.Lock()
		wait := p.h.backoff.Next()
		p.h.mu.Unlock()
		if err := sleepCtx(ctx, wait); err != nil || p.over() {
			return
		}
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		err := p.r.stores[p.name].pool.Ping(pctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			p.h.mu.Lock()
			p.h.lastErr = err
			p.h.mu.Unlock()
			continue
		}
		p.r.reached(p.name, p.h, p.episode)
		return
	}
}

// ---- splitting work by database ----

// part is the indexes of a request's items whose shards live in one
// database, in the request's order.
type part struct {
	name string
	st   *Store
	idx  []int
}

// split groups n items by the database of each one's shard, the parts in
// the order of their first item. An item whose shard is outside the map
// is an error.
func (r *Router) split(n int, shardOf func(i int) int) ([]part, error) {
	rt := r.cur.Load()
	var parts []part
	at := make(map[*Store]int, len(r.names))
	for i := range n {
		s := shardOf(i)
		if s < 0 || s >= len(rt.of) {
			return nil, fmt.Errorf("shard %d is outside the map of databases (%d shards)", s, len(rt.of))
		}
		st := rt.of[s]
		k, ok := at[st]
		if !ok {
			k = len(parts)
			at[st] = k
			parts = append(parts, part{name: rt.m.Shards[s], st: st})
		}
		parts[k].idx = append(parts[k].idx, i)
	}
	return parts, nil
}

// pick returns items[idx].
func pick[T any](items []T, idx []int) []T {
	out := make([]T, len(idx))
	for j, i := range idx {
		out[j] = items[i]
	}
	return out
}

// parallel runs f(0) … f(n-1) concurrently (f(0) alone on the caller's
// goroutine when n is 1) and waits for them.
func parallel(n int, f func(i int)) {
	if n == 1 {
		f(0)
		return
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { f(i) })
	}
	wg.Wait()
}
