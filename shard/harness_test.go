package shard

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"

	"github.com/shardrun/shardrun/detach"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/embedetcd"
	"github.com/shardrun/shardrun/internal/faultproxy"
	"github.com/shardrun/shardrun/internal/testsignal"
	"github.com/shardrun/shardrun/internal/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testutil.EtcdLeaks...)
}

const testPrefix = "/shardrun/test/"

// cluster is one embedded etcd and a set of in-process members.
type cluster struct {
	t      testing.TB
	etcd   *embedetcd.Server
	admin  *clientv3.Client
	shards int
	log    eventLog
	ttl    time.Duration

	mu sync.Mutex
	// members are keyed by themselves, not by id: two processes with one
	// runner id (a successor started while its predecessor was paused)
	// are two members.
	members map[*member]bool
	// groups[id] is the group of every member ever started, kept after
	// it leaves for the checks of its history.
	groups map[string]string
}

type member struct {
	id      string
	c       *cluster
	client  *clientv3.Client
	proxy   *faultproxy.Proxy
	machine *detach.Machine
	mgr     *Manager
	cancel  context.CancelFunc
	done    chan error
}

func newCluster(t testing.TB, shards int) *cluster {
	t.Helper()
	srv, admin := testutil.Etcd(t)
	c := &cluster{t: t, etcd: srv, admin: admin, shards: shards, log: eventLog{testsignal.New[Event]()}, ttl: 2 * time.Second,
		members: map[*member]bool{}, groups: map[string]string{}}
	t.Cleanup(func() {
		c.mu.Lock()
		ms := make([]*member, 0, len(c.members))
		for m := range c.members {
			ms = append(ms, m)
		}
		c.mu.Unlock()
		for _, m := range ms {
			m.crashStop()
		}
	})
	return c
}

// memberSetup is what a memberOpt may change before a member starts: its
// manager's config, its detach machine's config, and the test hooks of
// its manager.
type memberSetup struct {
	cfg    Config
	detach detach.Config
	hooks  hooks
}

type memberOpt func(*memberSetup)

func withHandoff(d time.Duration) memberOpt {
	return func(s *memberSetup) { s.cfg.HandoffTimeout = d }
}

// serving makes a member serve queues and handle kinds, which puts it in
// their group.
func serving(queues, kinds []string) memberOpt {
	return func(s *memberSetup) { s.cfg.Queues, s.cfg.Kinds = queues, kinds }
}

// withClock gives the member's manager and detach machine a clock of the
// test's: with a fake one, its keep-alives, retries and recovery window
// move only when the test moves it.
func withClock(c clock.Clock) memberOpt {
	return func(s *memberSetup) { s.cfg.Clock, s.detach.Clock = c, c }
}

func withLeaseTTL(ttl time.Duration) memberOpt {
	return func(s *memberSetup) { s.cfg.LeaseTTL = ttl }
}

// withoutJoinSettle: the member acts on a join at once (a fake clock that
// does not move would otherwise keep it settling).
func withoutJoinSettle() memberOpt {
	return func(s *memberSetup) { s.cfg.JoinSettle = -1 }
}

// withLogger sends the member's log to l.
func withLogger(l hclog.Logger) memberOpt {
	return func(s *memberSetup) { s.cfg.Logger = l }
}

// withHooks sets the test hooks of the member's manager.
func withHooks(set func(*hooks)) memberOpt {
	return func(s *memberSetup) { set(&s.hooks) }
}

// add starts a member; throughProxy puts a fault proxy between it and etcd.
func (c *cluster) add(id string, throughProxy bool, opts ...memberOpt) *member {
	c.t.Helper()
	m, err := c.start(id, throughProxy, opts...)
	if err != nil {
		c.t.Fatal(err)
	}
	return m
}

func (c *cluster) start(id string, throughProxy bool, opts ...memberOpt) (*member, error) {
	m := &member{id: id, c: c, done: make(chan error, 1)}
	endpoint := c.etcd.Endpoints()[0]
	if throughProxy {
		p, err := faultproxy.New(c.etcd.Addr())
		if err != nil {
			return nil, err
		}
		m.proxy = p
		endpoint = "http://" + p.Addr()
	}
	m.client = testutil.Client(c.t, endpoint)
	setup := memberSetup{
		cfg: Config{
			Client: m.client, Prefix: testPrefix, RunnerID: id, ShardCount: c.shards,
			LeaseTTL: c.ttl, HandoffTimeout: time.Second,
			Logger: hclog.New(&hclog.LoggerOptions{Name: id, Level: hclog.Warn, Output: testWriter{c.t}}),
		},
		detach: detach.Config{RecoveryWindow: 500 * time.Millisecond},
	}
	for _, o := range opts {
		o(&setup)
	}
	m.machine = detach.New(setup.detach)
	setup.cfg.Detach = m.machine
	mgr, err := New(setup.cfg)
	if err != nil {
		m.close()
		return nil, err
	}
	mgr.hooks = setup.hooks
	m.mgr = mgr
	mgr.ledger.events = c.log.Signal
	if err := mgr.Start(context.Background()); err != nil {
		m.close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go func() { m.done <- mgr.Run(ctx) }()
	c.mu.Lock()
	c.members[m] = true
	c.groups[id] = mgr.Group()
	c.mu.Unlock()
	return m, nil
}

// leave drains the member gracefully and waits for Run to return.
func (m *member) leave() {
	m.cancel()
	if err := <-m.done; err != nil {
		m.c.t.Errorf("%s: Run: %v", m.id, err)
	}
	m.forget()
}

// crashStop stops the member without draining, as if the process died: its
// keys stay until its lease expires.
func (m *member) crashStop() {
	if m.mgr != nil && m.cancel != nil {
		// A dead process can do no more work: its intervals end here.
		m.c.log.Emit(Event{Kind: Detached, Runner: m.id, Shard: -1, At: time.Now()})
		m.mgr.Orphan()
		m.cancel()
		<-m.done
	}
	m.forget()
}

func (m *member) forget() {
	m.close()
	m.c.mu.Lock()
	delete(m.c.members, m)
	m.c.mu.Unlock()
}

func (m *member) close() {
	if m.client != nil {
		m.client.Close()
	}
	if m.proxy != nil {
		m.proxy.Close()
	}
}

func (c *cluster) live() []*member {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*member, 0, len(c.members))
	for m := range c.members {
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// testGroup is the group of the test members, which serve no queue and
// handle no kind unless a test says so.
var testGroup = GroupOf(nil, nil)

// etcdOwners reads the owner keys of the test group directly.
func (c *cluster) etcdOwners() []string {
	c.t.Helper()
	return c.groupOwners(testGroup)
}

// groupOwners reads the owner keys of group directly: the owner of each
// of its shards ("" when free).
func (c *cluster) groupOwners(group string) []string {
	c.t.Helper()
	resp, err := c.admin.Get(context.Background(), testPrefix+"owners/", clientv3.WithPrefix())
	if err != nil {
		c.t.Fatal(err)
	}
	v := newView(c.shards)
	v.load(keys{testPrefix}, resp.Kvs, resp.Header.Revision)
	owners, _ := v.holders(group)
	return owners
}

// converged reports whether, in every group with a live member, every
// shard is owned in etcd and by the member the assignment gives it, every
// member is attached, owns what it is assigned, and is balanced within its
// group.
func (c *cluster) converged() (bool, string) {
	byGroup := map[string][]*member{}
	for _, m := range c.live() {
		byGroup[m.mgr.Group()] = append(byGroup[m.mgr.Group()], m)
	}
	for group, ms := range byGroup {
		if ok, why := c.groupConverged(group, ms); !ok {
			return false, group + ": " + why
		}
	}
	return true, ""
}

func (c *cluster) groupConverged(group string, ms []*member) (bool, string) {
	owners := c.groupOwners(group)
	counts := map[string]int{}
	for s, o := range owners {
		if o == "" {
			return false, fmt.Sprintf("shard %d has no owner", s)
		}
		counts[o]++
	}
	lo, hi := c.shards/len(ms), (c.shards+len(ms)-1)/len(ms)
	for _, m := range ms {
		st := m.mgr.Status()
		if st.State != StateAttached {
			return false, fmt.Sprintf("%s is %s", m.id, st.State)
		}
		if len(st.Owned) != len(st.Assigned) || len(st.Releasing) > 0 {
			return false, fmt.Sprintf("%s owns %d, assigned %d, releasing %d", m.id, len(st.Owned), len(st.Assigned), len(st.Releasing))
		}
		for _, se := range st.Owned {
			if owners[se.Shard] != m.id {
				return false, fmt.Sprintf("%s thinks it owns %d, etcd says %s", m.id, se.Shard, owners[se.Shard])
			}
		}
		if counts[m.id] < lo || counts[m.id] > hi {
			return false, fmt.Sprintf("%s owns %d, want %d..%d", m.id, counts[m.id], lo, hi)
		}
	}
	if len(counts) != len(ms) {
		return false, fmt.Sprintf("owners %v, members %d", counts, len(ms))
	}
	return true, ""
}

func (c *cluster) waitConverged(timeout time.Duration) time.Duration {
	c.t.Helper()
	return testutil.Until(c.t, timeout, "cluster convergence", c.converged)
}

// eventLog collects every member's ownership events on one clock.
type eventLog struct{ *testsignal.Signal[Event] }

// interval is a stretch during which one member could work on a shard:
// from the answer to its acquiring Txn until it detached, released (the
// delete was sent only after the work stopped) or lost the shard.
type interval struct {
	runner     string
	epoch      int64
	start, end time.Time
	sent       time.Time
}

// unit is a shard of a group, what one member at a time may own.
type unit struct {
	group string
	shard int
}

func (c *cluster) intervals() map[unit][]interval {
	events := c.log.Events()
	c.mu.Lock()
	groups := maps.Clone(c.groups)
	c.mu.Unlock()
	out := map[unit][]interval{}
	open := map[string]map[int]*interval{}
	closeAll := func(runner string, at time.Time, shard int) {
		for s, iv := range open[runner] {
			if shard >= 0 && s != shard {
				continue
			}
			iv.end = at
			u := unit{groups[runner], s}
			out[u] = append(out[u], *iv)
			delete(open[runner], s)
		}
	}
	for _, e := range events {
		if open[e.Runner] == nil {
			open[e.Runner] = map[int]*interval{}
		}
		switch e.Kind {
		case Acquired:
			open[e.Runner][e.Shard] = &interval{runner: e.Runner, epoch: e.Epoch, start: e.At, sent: e.Sent}
		case Released, Lost:
			closeAll(e.Runner, e.At, e.Shard)
		case Detached:
			closeAll(e.Runner, e.At, -1)
		}
	}
	far := time.Now().Add(time.Hour)
	for r := range open {
		closeAll(r, far, -1)
	}
	return out
}

// checkNoDoubleOwnership fails if two members could work on one shard of
// a group at the same time.
func (c *cluster) checkNoDoubleOwnership() {
	c.t.Helper()
	for s, ivs := range c.intervals() {
		sort.Slice(ivs, func(i, j int) bool { return ivs[i].start.Before(ivs[j].start) })
		for i := 1; i < len(ivs); i++ {
			prev, cur := ivs[i-1], ivs[i]
			if prev.runner != cur.runner && cur.start.Before(prev.end) {
				c.t.Errorf("shard %v: %s (epoch %d) acquired at %s while %s (epoch %d) could still work on it until %s",
					s, cur.runner, cur.epoch, cur.start.Format("15:04:05.000"), prev.runner, prev.epoch, prev.end.Format("15:04:05.000"))
			}
			if cur.epoch <= prev.epoch {
				c.t.Errorf("shard %v: epoch did not grow: %d after %d", s, cur.epoch, prev.epoch)
			}
		}
	}
}

// etcdWatcher records every write of the owner keys, to check that no two
// keys of a group ever name one shard at once (never two owners) and that every shard
// a key starts to name matches an acquisition a member observed.
type etcdWatcher struct {
	mu     sync.Mutex
	events []*clientv3.Event
	cancel context.CancelFunc
	done   chan struct{}
}

func (c *cluster) watchShards() *etcdWatcher {
	ctx, cancel := context.WithCancel(context.Background())
	w := &etcdWatcher{cancel: cancel, done: make(chan struct{})}
	resp, err := c.admin.Get(ctx, testPrefix+"owners/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		c.t.Fatal(err)
	}
	ch := c.admin.Watch(ctx, testPrefix+"owners/", clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(w.done)
		for r := range ch {
			w.mu.Lock()
			w.events = append(w.events, r.Events...)
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *etcdWatcher) check(c *cluster) int {
	c.t.Helper()
	w.cancel()
	<-w.done
	acquired := map[string]bool{}
	for _, e := range c.log.Events() {
		if e.Kind == Acquired {
			acquired[fmt.Sprintf("%d/%d/%s", e.Shard, e.Epoch, e.Runner)] = true
		}
	}
	k := keys{testPrefix}
	current := map[string]map[int]int64{} // owner key -> its terms
	for _, e := range w.events {
		group, id, ok := k.parseOwner(e.Kv.Key)
		if !ok {
			continue
		}
		before := current[string(e.Kv.Key)]
		var after map[int]int64
		if e.Type == clientv3.EventTypePut {
			var err error
			if after, err = decodeTerms(e.Kv.Value, e.Kv.ModRevision, c.shards); err != nil {
				c.t.Errorf("owner key %s: %v", e.Kv.Key, err)
			}
		}
		current[string(e.Kv.Key)] = after
		for s, epoch := range after {
			if before[s] == epoch {
				continue
			}
			if sid := fmt.Sprintf("%d/%d/%s", s, epoch, id); !acquired[sid] {
				c.t.Errorf("etcd shows %s acquire shard %d at epoch %d, but no member observed it", id, s, epoch)
			}
			for other, terms := range current {
				if other != string(e.Kv.Key) && strings.HasPrefix(other, k.group(group)) && terms[s] != 0 {
					c.t.Errorf("shard %d named by %s (epoch %d) while %s still names it (epoch %d)", s, e.Kv.Key, epoch, other, terms[s])
				}
			}
		}
	}
	return len(w.events)
}

// setAside takes m out of the cluster's checks (live, converged) while it
// keeps running: a process the test watches apart, such as a paused
// predecessor that shares its runner id with a live member. It stops
// when the test ends.
func (c *cluster) setAside(m *member) {
	c.mu.Lock()
	delete(c.members, m)
	c.mu.Unlock()
	c.t.Cleanup(m.crashStop)
}

// logLines is a member's log, kept for the test to read and passed on to
// the test's own.
type logLines struct {
	t     testing.TB
	mu    sync.Mutex
	lines []string
}

func (l *logLines) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	l.t.Log(line)
	l.mu.Lock()
	l.lines = append(l.lines, line)
	l.mu.Unlock()
	return len(p), nil
}

// matching returns the lines that contain every one of parts.
func (l *logLines) matching(parts ...string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			out = append(out, line)
		}
	}
	return out
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// recorder keeps every etcd event under the test prefix, in revision
// order, from the moment it starts: the history that checks of what etcd
// held at every revision replay.
type recorder struct {
	mu      sync.Mutex
	events  []*clientv3.Event
	last    int64 // revision of the last event received
	changed chan struct{}
	cancel  context.CancelFunc
	done    chan struct{}
}

func (c *cluster) record() *recorder {
	c.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := c.admin.Get(ctx, testPrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		cancel()
		c.t.Fatal(err)
	}
	r := &recorder{changed: make(chan struct{}), cancel: cancel, done: make(chan struct{})}
	ch := c.admin.Watch(ctx, testPrefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		defer close(r.done)
		for resp := range ch {
			if len(resp.Events) == 0 {
				continue
			}
			r.mu.Lock()
			r.events = append(r.events, resp.Events...)
			r.last = resp.Events[len(resp.Events)-1].Kv.ModRevision
			close(r.changed)
			r.changed = make(chan struct{})
			r.mu.Unlock()
		}
	}()
	c.t.Cleanup(r.stop)
	return r
}

// through returns every event up to rev, waiting for them (the watch is
// complete up to its last event).
func (r *recorder) through(t testing.TB, rev int64) []*clientv3.Event {
	t.Helper()
	deadline := time.NewTimer(10 * time.Second)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		last, changed := r.last, r.changed
		var out []*clientv3.Event
		if last >= rev {
			for _, ev := range r.events {
				if ev.Kv.ModRevision <= rev {
					out = append(out, ev)
				}
			}
		}
		r.mu.Unlock()
		if last >= rev {
			return out
		}
		select {
		case <-changed:
		case <-deadline.C:
			t.Fatalf("the recorder saw events up to revision %d, not %d", last, rev)
		}
	}
}

// sofar returns the events received so far.
func (r *recorder) sofar() []*clientv3.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// mark writes a key under the test prefix that nothing reads and returns
// its revision: a recorder that has seen it has seen everything before.
func (c *cluster) mark() int64 {
	c.t.Helper()
	resp, err := c.admin.Put(context.Background(), testPrefix+"unrelated/mark", "")
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Header.Revision
}

func (r *recorder) stop() {
	r.cancel()
	<-r.done
}

// checkNamedOnce replays events through History and fails for every
// revision at which two owner keys of one group named one shard.
func checkNamedOnce(t testing.TB, events []*clientv3.Event, shards int) {
	t.Helper()
	h := NewHistory(testPrefix, shards)
	holder := map[unit]UnitEvent{}
	for _, ev := range events {
		for _, u := range h.Apply(ev) {
			k := unit{u.Group, u.Shard}
			prev, held := holder[k]
			switch {
			case !u.Acquired && held && prev.Runner == u.Runner:
				delete(holder, k)
			case u.Acquired && held && prev.Runner != u.Runner:
				t.Errorf("revision %d: %s's key names shard %d (epoch %d) while %s's still names it (epoch %d)",
					u.Rev, u.Runner, u.Shard, u.Epoch, prev.Runner, prev.Epoch)
			case u.Acquired:
				holder[k] = u
			}
		}
	}
}
