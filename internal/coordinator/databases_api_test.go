package coordinator

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/pgtest"
	"github.com/shardrun/shardrun/internal/testutil"
	"github.com/shardrun/shardrun/shard"
	"github.com/shardrun/shardrun/store"
)

// POST /api/shards/{n}/move records the move (202), which the leader
// makes; GET /api/databases shows the shard in its new database once it
// is done. A bad request is refused naming what is wrong.
func TestMoveAShardThroughTheAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	m, _, err := shard.EnsureCluster(context.Background(), e.admin, prefix, 16, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := pgtest.NewCluster(t, store.Options{MaxConns: 10}, m)
	c := e.start("coord", nil, func(c *Config) { c.APIToken = "tok"; c.Store, c.Router = nil, r })
	base := "http://" + c.Addr()
	for _, bad := range []struct {
		path, body string
		code       int
		want       string
	}{
		{"/api/shards/3/move", `{"to": "b"}`, 401, ""},
		{"/api/shards/x/move", `{"to": "b"}`, 400, `{"error":"invalid shard: \"x\" in the path is not a shard number","field":"shard"}`},
		{"/api/shards/16/move", `{"to": "b"}`, 400, `{"error":"invalid shard: 16 is not one of the cluster's 16 shards (0-15)","field":"shard"}`},
		{"/api/shards/3/move", `{"to": "c"}`, 400, `{"error":"invalid to: the cluster has no database \"c\" (its databases: a, b)","field":"to"}`},
		{"/api/shards/3/move", `{"to": "a"}`, 400, `{"error":"invalid to: shard 3 is in database a already","field":"to"}`},
		{"/api/shards/3/move", `{}`, 400, `{"error":"invalid to: the name of the database to move the shard to is required","field":"to"}`},
	} {
		token := "tok"
		if bad.code == 401 {
			token = ""
		}
		code, body := testutil.HTTP(t, "POST", base+bad.path, token, bad.body)
		if code != bad.code || (bad.want != "" && body != bad.want+"\n" && body != bad.want) {
			t.Fatalf("POST %s %s: %d %s, want %d %s", bad.path, bad.body, code, body, bad.code, bad.want)
		}
	}
	code, body := testutil.HTTP(t, "POST", base+"/api/shards/3/move", "tok", `{"to": "b"}`)
	var acc MoveAccepted
	if code != 202 || json.Unmarshal([]byte(body), &acc) != nil || acc.Move != (MoveView{Shard: 3, From: "a", To: "b", Phase: "leaving"}) || acc.Revision == 0 {
		t.Fatalf("POST /api/shards/3/move: %d %s", code, body)
	}
	testutil.Until(t, 30*time.Second, "the move done", func() (bool, string) {
		v, err := c.Databases(context.Background())
		if err != nil {
			return false, err.Error()
		}
		b, _ := json.Marshal(v)
		return len(v.Moves) == 0 && v.Databases[0].Shards == "0-2,4-7" && v.Databases[1].Shards == "3,8-15", string(b)
	})
}
