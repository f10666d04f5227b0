package main

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/shardrun/shardrun/internal/certgen"
	"github.com/shardrun/shardrun/internal/cli"
)

const dsn = "postgres://u@127.0.0.1:1/db" // nothing listens: a start that connects fails with exit 1

// The coordinator validates as much as the runner, all of it before it
// connects: exit 2 and one line naming the flag. A 0 given for a flag with
// a default is an error, not the default.
func TestEverySettingIsCheckedBeforeConnecting(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--cluster", "a/b"}, "--cluster"},
		{[]string{"--etcd-prefix", "shardrun"}, "--etcd-prefix"},
		{[]string{"--etcd-prefix", "/shardrun"}, "--etcd-prefix"},
		{[]string{"--db-max-conns", "0"}, "--db-max-conns"},
		{[]string{"--db-max-conns", "5000"}, "--db-max-conns"},
		{[]string{"--election-ttl", "0"}, "--election-ttl"},
		{[]string{"--election-ttl", "1500ms"}, "--election-ttl"},
		{[]string{"--election-ttl", "2h"}, "--election-ttl"},
		{[]string{"--sweep-batch", "0"}, "--sweep-batch"},
		{[]string{"--sweep-batch", "1000000"}, "--sweep-batch"},
		{[]string{"--sweep-interval", "0"}, "--sweep-interval"},
		{[]string{"--max-attempts", "0"}, "--max-attempts"},
		{[]string{"--max-attempts", "1001"}, "--max-attempts"},
		{[]string{"--shard-count", "0"}, "--shard-count"},
		{[]string{"--shard-count", "1000000"}, "--shard-count"},
		{[]string{"--retry-base", "10s", "--retry-cap", "1s"}, "--retry-cap"},
		{[]string{"--retry-base", "0"}, "--retry-base"},
		{[]string{"--stale-threshold", "5s", "--heartbeat-interval", "5s"}, "--stale-threshold"},
		{[]string{"--stale-threshold", "48h"}, "--stale-threshold"},
		{[]string{"--heartbeat-interval", "0"}, "--heartbeat-interval"},
		{[]string{"--etcd-endpoints", "http://127.0.0.1:99999"}, "--etcd-endpoints"},
		{[]string{"--http-addr", "127.0.0.1:99999"}, "--http-addr"},
		{[]string{"--http-addr", "0.0.0.0:8080", "--api-token", "with space"}, "--api-token"},
		{[]string{"--coordinator-id", "a/b"}, "--coordinator-id"},
		{[]string{"--embed-etcd", "/tmp/x", "--embed-etcd-addr", "127.0.0.1:0"}, "--embed-etcd-addr"},
		{[]string{"--dev-rate", "-1"}, "--dev-rate"},
		{[]string{"--dev", "--dev-runners", "1000"}, "--dev-runners"},
		{[]string{"--log-format", "xml"}, "--log-format"},
	} {
		var out, errOut bytes.Buffer
		code := run(append([]string{"--database-url", dsn}, tc.args...), func(string) string { return "" }, &out, &errOut)
		msg := strings.TrimSpace(errOut.String())
		if code != 2 || !strings.Contains(msg, tc.want) || strings.Contains(msg, "\n") {
			t.Errorf("%v: exit %d %q; want exit 2 and one line naming %s", tc.args, code, msg, tc.want)
		}
	}
}

func TestSecretsFromFiles(t *testing.T) {
	read := func(name string, _ int) ([]byte, error) {
		switch name {
		case "/run/db":
			return []byte(dsn + "\n"), nil
		case "/run/tok":
			return []byte("api-s3cret\n"), nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	env := map[string]string{"DATABASE_URL_FILE": "/run/db", "SHARDRUN_API_TOKEN_FILE": "/run/tok", "SHARDRUN_HTTP_ADDR": "0.0.0.0:8080"}
	o, err := parse(nil, func(k string) string { return env[k] }, read, io.Discard)
	if err != nil || o.databaseURL != dsn || o.apiToken != "api-s3cret" || len(o.warnings) != 0 {
		t.Fatalf("%v %+v", err, o)
	}
	o, err = parse([]string{"--database-url", "postgres://u:pw@h/db", "--api-token", "api-s3cret"}, func(string) string { return "" }, read, io.Discard)
	if err != nil || strings.Join(o.warnings, ",") != "database-url,api-token" {
		t.Fatalf("secrets on the command line must draw warnings: %v %v", err, o.warnings)
	}
	env = map[string]string{"SHARDRUN_API_TOKEN": "x", "SHARDRUN_API_TOKEN_FILE": "/run/tok", "DATABASE_URL": dsn}
	if _, err := parse(nil, func(k string) string { return env[k] }, read, io.Discard); err == nil ||
		!strings.Contains(err.Error(), "SHARDRUN_API_TOKEN and SHARDRUN_API_TOKEN_FILE are both set") {
		t.Fatalf("both forms of a secret: %v", err)
	}
}

// The etcd client's TLS comes by file as in the compose deployment (the
// CA without the embedded etcd's certificate is the client's, not a half
// server configuration); plain endpoints with it, and half a pair, are
// refused naming the flag.
func TestEtcdTLSFlags(t *testing.T) {
	ca, err := certgen.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	pair, err := ca.Issue("c", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{"/certs/ca.crt": ca.PEM, "/certs/c.crt": pair.Cert, "/certs/c.key": pair.Key}
	read := func(name string, _ int) ([]byte, error) {
		if b, ok := files[name]; ok {
			return b, nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	env := map[string]string{"DATABASE_URL": dsn, "SHARDRUN_ETCD_ENDPOINTS": "https://etcd1:2379,https://etcd2:2379",
		"SHARDRUN_ETCD_CA_FILE": "/certs/ca.crt", "SHARDRUN_ETCD_CERT_FILE": "/certs/c.crt", "SHARDRUN_ETCD_KEY_FILE": "/certs/c.key"}
	getenv := func(k string) string { return env[k] }
	if o, err := parse(nil, getenv, read, io.Discard); err != nil || o.etcdCA != strings.TrimSuffix(string(ca.PEM), "\n") || len(o.warnings) != 0 {
		t.Fatalf("etcd TLS from files: %v", err)
	}
	for args, want := range map[string]string{
		"--etcd-endpoints http://etcd1:2379":  "--etcd-endpoints",
		"--embed-etcd-cert-file /certs/c.crt": "--embed-etcd-cert and --embed-etcd-key",
		"--http-cert-file /certs/c.crt":       "--http-cert and --http-key",
	} {
		if _, err := parse(strings.Fields(args), getenv, read, io.Discard); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %s", args, err, want)
		}
	}
}

// FuzzCoordinatorFlags feeds arguments and environment variables (lines
// "$NAME=value") to the flag layer: it never panics, refuses with one line
// naming a flag or variable, and what it accepts is a valid configuration.
func FuzzCoordinatorFlags(f *testing.F) {
	for _, s := range []string{
		"--database-url\npostgres://u@h/db", "$DATABASE_URL=postgres://u@h/db\n--election-ttl\n0",
		"--dev\n--dev-runners\n0", "--dev\n--http-addr\n127.0.0.1:0", "$DATABASE_URL=x\n--cluster\na/b",
		"--database-url-file\n/run/db\n--sweep-batch\n1000000", "--embed-etcd\n/tmp/e\n--database-url\npostgres://h/db",
		"--api-token-file\n/run/tok\n--http-addr\n:8080\n--database-url\npostgres://h/db", "--help",
	} {
		f.Add(s)
	}
	read := func(name string, _ int) ([]byte, error) {
		switch name {
		case "/run/db":
			return []byte("postgres://u:pw@h/db\n"), nil
		case "/run/tok":
			return []byte("t0k\n"), nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	f.Fuzz(func(t *testing.T, in string) {
		var args []string
		env := map[string]string{}
		for _, line := range strings.Split(in, "\n") {
			if k, v, ok := strings.Cut(strings.TrimPrefix(line, "$"), "="); ok && strings.HasPrefix(line, "$") {
				env[k] = v
			} else {
				args = append(args, line)
			}
		}
		o, err := parse(args, func(k string) string { return env[k] }, read, io.Discard)
		if errors.Is(err, cli.ErrHelp) {
			return
		}
		if err != nil {
			msg := err.Error()
			if strings.Contains(cli.OneLine(err), "\n") || !(strings.Contains(msg, "--") || strings.Contains(msg, "DATABASE_URL") || strings.Contains(msg, "SHARDRUN_")) {
				t.Fatalf("%q: %q does not name a flag", in, msg)
			}
			return
		}
		if err := o.config().Validate(); err != nil {
			t.Fatalf("%q: accepted, then refused: %v", in, err)
		}
		if err := o.storeOptions().Validate(); err != nil {
			t.Fatalf("%q: accepted, then refused: %v", in, err)
		}
	})
}

// Every *-file flag (secrets, keys, certificates) reads its file with a
// bound: /dev/zero (endless, size 0 to stat) and a sparse 4 GiB file each
// stop the coordinator with exit status 2 and one line naming the flag.
// Issue 34: --http-key-file /dev/zero ran it out of memory.
func TestEveryFileFlagIsReadWithABound(t *testing.T) {
	var help, errOut bytes.Buffer
	if code := run([]string{"--help"}, func(string) string { return "" }, &help, &errOut); code != 0 {
		t.Fatalf("--help: %d %s", code, errOut.String())
	}
	flags := regexp.MustCompile(`--([a-z-]+-file)\b`).FindAllStringSubmatch(help.String(), -1)
	if len(flags) < 9 {
		t.Fatalf("only %d file flags in --help", len(flags))
	}
	sparse := filepath.Join(t.TempDir(), "sparse")
	if err := os.WriteFile(sparse, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(sparse, 4<<30); err != nil {
		t.Fatal(err)
	}
	for _, m := range flags {
		for _, path := range []string{"/dev/zero", sparse} {
			var out, errOut bytes.Buffer
			arg := path
			if m[1] == "database-file" {
				arg = "main=" + path // NAME=PATH
			}
			code := run([]string{"--" + m[1], arg}, func(string) string { return "" }, &out, &errOut)
			msg := strings.TrimSpace(errOut.String())
			if code != 2 || !strings.HasPrefix(msg, "coordinator: --"+m[1]+": "+path+" is larger than") || strings.Contains(msg, "\n") {
				t.Errorf("--%s %s: exit %d %q; want exit 2 and one line naming the flag", m[1], path, code, msg)
			}
		}
	}
}
