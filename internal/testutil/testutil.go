// Package testutil holds what the test packages share: polling with a
// deadline instead of sleeping, an embedded etcd per test, the goleak
// allowances for it, free loopback addresses, one HTTP request helper, and
// the one rule for a test whose tool is missing.
package testutil

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/shardrun/shardrun/internal/embedetcd"
)

// EtcdLeaks are the goroutines embedded etcd and gRPC leave running after
// Close; every package that embeds etcd passes them to goleak.
var EtcdLeaks = []goleak.Option{
	goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	goleak.IgnoreAnyFunction("go.etcd.io/etcd/pkg/v3/schedule.(*fifo).run"),
}

// MissingTool ends a test whose external tool (a browser, docker-compose) is
// not installed. On a developer's machine it skips with how to install it;
// in CI (CI set, where .ci/run installs every tool) it fails, so a check
// never silently stops running there.
func MissingTool(t testing.TB, why string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatalf("%s (CI is set: .ci/run must have installed it)", why)
	}
	t.Skip(why)
}

// Until polls cond every 5ms until it holds, and returns how long that took.
// When timeout passes first it fails the test naming what it waited for and
// the last reason cond gave.
func Until(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		ok, why := cond()
		if ok {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			t.Fatalf("%s: not within %s: %s", what, timeout, why)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// WaitFor is Until for conditions without a reason.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	return Until(t, timeout, what, func() (bool, string) { return cond(), "condition false" })
}

// FreeAddr returns a loopback host:port nothing listens on now.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Etcd starts an embedded single-node etcd for one test and returns it with
// a client; both close when the test ends.
func Etcd(t testing.TB) (*embedetcd.Server, *clientv3.Client) {
	t.Helper()
	srv, err := embedetcd.Start(context.Background(), embedetcd.Config{Dir: t.TempDir(), Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	return srv, Client(t, srv.Endpoints()...)
}

// Client connects to etcd, with keep-alive probes short enough that a test
// cutting the connection sees the client notice within a second. It closes
// when the test ends, if the test has not closed it already.
func Client(t testing.TB, endpoints ...string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            endpoints,
		Logger:               zap.NewNop(),
		DialTimeout:          2 * time.Second,
		DialKeepAliveTime:    500 * time.Millisecond,
		DialKeepAliveTimeout: 500 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// httpClient bounds every test request, so a hung server fails the test
// instead of hanging it.
var httpClient = &http.Client{Timeout: 5 * time.Second}

// HTTP sends one request with an optional bearer token, body and header
// name/value pairs, and returns the status and body; a request that gets no
// answer returns status 0 and the error, so that tests polling a server
// that is still starting can retry.
func HTTP(t testing.TB, method, url, token, body string, headers ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
