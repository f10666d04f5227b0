package store_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/tasks"
)

// createdIn finds the function or view a code file creates.
var createdIn = regexp.MustCompile(`(?s)CREATE OR REPLACE (FUNCTION|VIEW) (\w+)`)

// TestLiveCodeIsTheFiles checks that the database runs exactly the layout's
// code files (store/sql): every function body is its file's, the view is
// its file's, and no shardrun_ function lives in the database that no file
// holds (a leftover of an earlier migration).
func TestLiveCodeIsTheFiles(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	files, err := filepath.Glob("sql/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("code files: %v %v", files, err)
	}
	defined := map[string]bool{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		m := createdIn.FindStringSubmatch(text)
		if m == nil {
			t.Fatalf("%s creates no function or view", f)
		}
		kind, name := m[1], m[2]
		defined[name] = true
		if filepath.Base(f) != name+".sql" {
			t.Errorf("%s creates %s: one file per object, named after it", f, name)
		}
		switch kind {
		case "FUNCTION":
			body := text[strings.Index(text, "$$")+2 : strings.LastIndex(text, "$$")]
			var live string
			if err := s.Pool().QueryRow(ctx, `SELECT prosrc FROM pg_proc WHERE proname = $1`, name).Scan(&live); err != nil {
				t.Errorf("function %s of %s: %v", name, f, err)
				continue
			}
			if live != body {
				t.Errorf("the live body of %s is not %s's", name, f)
			}
		case "VIEW":
			tmp := "test_" + name
			exec(t, s, strings.Replace(text, "VIEW "+name, "TEMP VIEW "+tmp, 1))
			var same bool
			if err := s.Pool().QueryRow(ctx, `SELECT pg_get_viewdef($1::regclass) = pg_get_viewdef($2::regclass)`, name, tmp).Scan(&same); err != nil || !same {
				t.Errorf("the live view %s is not %s's (%v)", name, f, err)
			}
		}
	}
	rows, err := s.Pool().Query(ctx, `SELECT proname FROM pg_proc WHERE proname LIKE 'shardrun\_%' AND pronamespace = 'public'::regnamespace`)
	if err != nil {
		t.Fatal(err)
	}
	live, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range live {
		if !defined[name] {
			t.Errorf("function %s lives in the database but in no file of store/sql", name)
		}
	}
}

// TestCodeIsAppliedWhenItChanges: a database whose code is not the files'
// (an earlier build's, or changed by hand) gets the files' at the next
// Migrate; one whose code is the files' is left alone.
func TestCodeIsAppliedWhenItChanges(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	var before time.Time
	if err := s.Pool().QueryRow(ctx, `SELECT applied_at FROM shardrun_code`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var again time.Time
	if err := s.Pool().QueryRow(ctx, `SELECT applied_at FROM shardrun_code`).Scan(&again); err != nil || !again.Equal(before) {
		t.Fatalf("the same code was applied again: %v %v", again, err)
	}
	exec(t, s, `CREATE OR REPLACE FUNCTION shardrun_urgent(priority smallint) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$ SELECT false $$`)
	exec(t, s, `UPDATE shardrun_code SET hash = 'an earlier build'`)
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var urgent bool
	if err := s.Pool().QueryRow(ctx, `SELECT shardrun_urgent(1::smallint)`).Scan(&urgent); err != nil || !urgent {
		t.Fatalf("the files' code was not applied over an earlier one: %v %v", urgent, err)
	}
}

var errRolledBack = errors.New("rolled back on purpose")

// TestRulesAgree checks the rules Go and SQL both need against each
// other: which priorities are urgent, what names a queue, the defaults of
// a raw insert.
func TestRulesAgree(t *testing.T) {
	t.Parallel()
	s := setup(t)
	ctx := context.Background()
	for p := tasks.MostUrgent; p <= tasks.LeastUrgent; p++ {
		var urgent bool
		if err := s.Pool().QueryRow(ctx, `SELECT shardrun_urgent($1::smallint)`, p).Scan(&urgent); err != nil {
			t.Fatal(err)
		}
		if urgent != tasks.Urgent(p) {
			t.Errorf("priority %d: urgent in SQL %v, in Go %v", p, urgent, tasks.Urgent(p))
		}
	}
	var queue string
	var priority int
	if err := s.Pool().QueryRow(ctx, `SELECT
		(SELECT column_default FROM information_schema.columns WHERE table_name = 'tasks' AND column_name = 'queue'),
		(SELECT column_default FROM information_schema.columns WHERE table_name = 'tasks' AND column_name = 'priority')::int`).Scan(&queue, &priority); err != nil {
		t.Fatal(err)
	}
	if queue != "'"+tasks.DefaultQueue+"'::text" || priority != tasks.DefaultPriority {
		t.Errorf("raw inserts default to queue %s and priority %d; Go to %q and %d", queue, priority, tasks.DefaultQueue, tasks.DefaultPriority)
	}
	names := []string{"default", "emails", "a.b-c_d", strings.Repeat("q", tasks.MaxQueueLen), strings.Repeat("q", tasks.MaxQueueLen+1),
		"", " ", "fz sql q", "é", "a/b", "a\tb", "ü", "Q1"}
	rnd := rand.New(rand.NewPCG(1, 2))
	alphabet := []rune("aZ09._- /é\x01'\"%")
	for range 200 {
		n := make([]rune, rnd.IntN(6))
		for i := range n {
			n[i] = alphabet[rnd.IntN(len(alphabet))]
		}
		names = append(names, string(n))
	}
	for _, name := range names {
		goOK := tasks.CheckQueue(name) == nil
		// A producer's raw insert, rolled back.
		err := pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO tasks (kind, shard, key, queue) VALUES ('k', 0, 'k', $1)`, name); err != nil {
				return err
			}
			return errRolledBack
		})
		sqlOK := errors.Is(err, errRolledBack)
		if goOK != sqlOK {
			t.Errorf("queue %q: the API says %v, the database %v (%v)", name, goOK, sqlOK, err)
		}
	}
}

// TestNotificationEncodingRoundTrips: what shardrun_notify (the one
// encoder) sends, the listener decodes into the same shards.
func TestNotificationEncodingRoundTrips(t *testing.T) {
	t.Parallel()
	s, _ := pgtest.NewStore(t, store.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got := make(chan store.Notification, 16)
	l := s.NewListener(hclog.NewNullLogger(), func(n store.Notification) { got <- n })
	done := make(chan error, 1)
	lctx, stop := context.WithCancel(ctx)
	go func() { done <- l.Run(lctx) }()
	defer func() { stop(); <-done }()
	if n := <-got; !n.All {
		t.Fatalf("first notification %+v, want the one after connecting (all)", n)
	}
	many := make([]int32, 3000)
	for i := range many {
		many[i] = int32(i)
	}
	for _, tc := range []struct {
		shards []int32
		urgent []bool
		want   store.Notification
	}{
		{[]int32{10, 3, 10}, []bool{false, true, false}, store.Notification{Shards: []int{3, 10}, Urgent: []int{3}}},
		{[]int32{7}, nil, store.Notification{Shards: []int{7}}},
		{many, nil, store.Notification{All: true}},
		{nil, nil, store.Notification{All: true}},
	} {
		exec(t, s, `SELECT shardrun_notify($1, $2)`, tc.shards, tc.urgent)
		var n store.Notification
		select {
		case n = <-got:
		case <-ctx.Done():
			t.Fatal("no notification")
		}
		if n.All != tc.want.All || !slices.Equal(n.Shards, tc.want.Shards) || !slices.Equal(n.Urgent, tc.want.Urgent) {
			t.Errorf("shards %d urgent %v: decoded %+v, want %+v", len(tc.shards), tc.urgent, n, tc.want)
		}
	}
}
