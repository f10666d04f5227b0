package integration

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/shardrun/shardrun/internal/certgen"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/pgtmp"
	"github.com/shardrun/shardrun/internal/testutil"
)

// A cluster with TLS on every connection: the coordinator's embedded etcd
// serves client TLS and requires client certificates (mutual TLS),
// PostgreSQL runs with ssl=on and every process connects with
// sslmode=verify-full, and the API and the runners' admin endpoints serve
// HTTPS with their tokens. Tasks enqueued over HTTPS complete; an etcd
// client without a certificate is refused; the runners' database sessions
// are encrypted.
func TestClusterWithTLSEverywhere(t *testing.T) {
	runnerBin, coordBin := binaries(t)
	dir := t.TempDir()
	ca, err := certgen.NewCA("shardrun-it")
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{"ca.crt": ca.PEM}
	for _, name := range []string{"etcd", "client", "pg", "http"} {
		pair, err := ca.Issue(name, "127.0.0.1", "localhost")
		if err != nil {
			t.Fatal(err)
		}
		files[name+".crt"], files[name+".key"] = pair.Cert, pair.Key
	}
	file := func(name string) string { return filepath.Join(dir, name) }
	for name, b := range files {
		if err := os.WriteFile(file(name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	ctx := context.Background()
	pg, err := pgtmp.Start(ctx, pgtmp.Options{TLS: &pgtmp.TLS{Cert: files["pg.crt"], Key: files["pg.key"]}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pg.Stop() })
	if _, err := pg.CreateDatabase(ctx, "tls"); err != nil {
		t.Fatal(err)
	}
	dsn := pg.TLSDSN("tls", file("ca.crt"))
	etcdAddr, httpAddr := testutil.FreeAddr(t), testutil.FreeAddr(t)
	etcdTLS := []string{"--etcd-ca-file", file("ca.crt"), "--etcd-cert-file", file("client.crt"), "--etcd-key-file", file("client.key")}
	common := append([]string{"--cluster", "tls", "--shard-count", "16", "--database-url", dsn, "--log-level", "warn"}, etcdTLS...)

	start(t, "coordinator", coordBin, append(common, "--embed-etcd", file("etcd-data"), "--embed-etcd-addr", etcdAddr,
		"--embed-etcd-cert-file", file("etcd.crt"), "--embed-etcd-key-file", file("etcd.key"),
		"--http-addr", httpAddr, "--http-cert-file", file("http.crt"), "--http-key-file", file("http.key"),
		"--api-token", apiToken, "--election-ttl", "2s")...)
	https := httpsClient(t, files["ca.crt"])
	waitHTTPS(t, https, "https://"+httpAddr+"/healthz")
	admins := []string{testutil.FreeAddr(t), testutil.FreeAddr(t)}
	for i, admin := range admins {
		start(t, fmt.Sprintf("runner-%d", i), runnerBin, append(common, "--etcd-endpoints", "https://"+etcdAddr,
			"--runner-id", fmt.Sprintf("tls-%d", i), "--admin-addr", admin, "--admin-token", adminToken,
			"--admin-cert-file", file("http.crt"), "--admin-key-file", file("http.key"), "--lease-ttl", "2s")...)
	}
	for _, admin := range admins {
		waitHTTPS(t, https, "https://"+admin+"/readyz")
	}

	var ids []int64
	for i := range 20 {
		var created struct{ ID int64 }
		request(t, https, "POST", "https://"+httpAddr+"/api/tasks", apiToken, fmt.Sprintf(`{"kind": "noop", "key": "k-%d"}`, i), http.StatusCreated, &created)
		ids = append(ids, created.ID)
	}
	testutil.Until(t, 30*time.Second, "the tasks completed", func() (bool, string) {
		for _, id := range ids {
			var task struct{ State string }
			request(t, https, "GET", fmt.Sprintf("https://%s/api/tasks/%d", httpAddr, id), apiToken, "", http.StatusOK, &task)
			if task.State != "completed" {
				return false, fmt.Sprintf("task %d is %s", id, task.State)
			}
		}
		return true, ""
	})

	// Plain HTTP to the admin endpoint gets no answer a client could use.
	if resp, err := http.Get("http://" + admins[0] + "/readyz"); err == nil {
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Fatal("the admin endpoint answered plain HTTP")
		}
	}
	// etcd requires a client certificate.
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.PEM)
	anon, err := clientv3.New(clientv3.Config{Endpoints: []string{"https://" + etcdAddr}, DialTimeout: 2 * time.Second,
		TLS: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, Logger: zap.NewNop()})
	if err == nil {
		gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = anon.Get(gctx, "/shardrun/")
		cancel()
		_ = anon.Close()
	}
	if err == nil {
		t.Fatal("the embedded etcd served a client without a certificate")
	}
	// The runners' sessions are encrypted (verify-full would not connect
	// otherwise; pg_stat_ssl shows it).
	db, err := pgx.Connect(ctx, pg.DSN("tls"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(ctx)
	var plain, encrypted int
	if err := db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl)
		FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.application_name LIKE 'shardrun-%'`).Scan(&plain, &encrypted); err != nil {
		t.Fatal(err)
	}
	if plain != 0 || encrypted == 0 {
		t.Fatalf("shardrun sessions: %d plain, %d over TLS", plain, encrypted)
	}
	t.Logf("%d tasks completed over TLS on etcd (mutual), PostgreSQL (verify-full, %d sessions) and HTTPS", len(ids), encrypted)
}

// start runs a binary until the test ends, its output in the test's log
// when it fails.
func start(t *testing.T, name, bin string, args ...string) {
	t.Helper()
	logs := &linewriter.Buffer{}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s:\n%s", name, logs.String())
		}
	})
}

func httpsClient(t *testing.T, caPEM []byte) *http.Client {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatal("no CA")
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}
}

func waitHTTPS(t *testing.T, c *http.Client, url string) {
	t.Helper()
	testutil.Until(t, 60*time.Second, url+" answers 200", func() (bool, string) {
		resp, err := c.Get(url)
		if err != nil {
			return false, err.Error()
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
}

func request(t *testing.T, c *http.Client, method, url, token, body string, want int, into any) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("%s %s: %s %s", method, url, resp.Status, b)
	}
	if err := json.Unmarshal(b, into); err != nil {
		t.Fatalf("%s %s: %v: %s", method, url, err, b)
	}
}
