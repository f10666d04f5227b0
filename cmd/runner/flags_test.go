package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/executor"
	"github.com/shardrun/shardrun/internal/runner"
)

const dsn = "postgres://u@127.0.0.1:1/db" // nothing listens: a start that connects fails with exit 1

// Every numeric and duration flag has bounds, and every bad value stops the
// runner with exit 2 and one line naming the flag, before it connects.
func TestEveryFlagIsBounded(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--max-workers", "1000000000000"}, nil, "--max-workers"},
		{[]string{"--max-workers", "100001"}, nil, "--max-workers"},
		{[]string{"--max-workers", "0"}, nil, "--max-workers"},
		{[]string{"--shard-count", "1000000"}, nil, "--shard-count"},
		{[]string{"--shard-count", "0"}, nil, "--shard-count"},
		{[]string{"--db-max-conns", "1"}, nil, "--db-max-conns"},
		{[]string{"--db-max-conns", "1001"}, nil, "--db-max-conns"},
		{[]string{"--db-max-conns", "4294967298"}, nil, "--db-max-conns"}, // 2 once truncated to int32
		{[]string{"--lease-ttl", "2h"}, nil, "--lease-ttl"},
		{[]string{"--lease-ttl", "-10s"}, nil, "--lease-ttl"},
		{[]string{"--detach-margin", "0"}, nil, "--detach-margin"},
		{[]string{"--lease-ttl", "3s", "--detach-margin", "2700ms"}, nil, "--detach-margin"}, // no keep-alive round (TTL/8) could land
		{[]string{"--keepalive-failures", "101"}, nil, "--keepalive-failures"},
		{[]string{"--recovery-window", "2h"}, nil, "--recovery-window"},
		{[]string{"--recovery-window", "-1s"}, nil, "--recovery-window"},
		{[]string{"--heartbeat-interval", "1ns"}, nil, "--heartbeat-interval"},
		{[]string{"--poll-interval", "2h"}, nil, "--poll-interval"},
		{[]string{"--handoff-timeout", "0"}, nil, "--handoff-timeout"},
		{[]string{"--handoff-timeout", "2h"}, nil, "--handoff-timeout"},
		{[]string{"--retry-base", "1us"}, nil, "--retry-base"},
		{[]string{"--retry-cap", "48h"}, nil, "--retry-cap"},
		{[]string{"--etcd-endpoints", "http://127.0.0.1:99999"}, nil, "--etcd-endpoints"},
		{[]string{"--admin-addr", "127.0.0.1:99999"}, nil, "--admin-addr"},
		{[]string{"--admin-addr", "0.0.0.0:9090", "--admin-token", "two words"}, nil, "--admin-token"},
		{[]string{"--cluster", "a/b"}, nil, "--cluster"},
		{[]string{"--etcd-prefix", "shardrun/"}, nil, "--etcd-prefix"},
		{[]string{"--runner-id", "a b"}, nil, "--runner-id"},
		{nil, map[string]string{"SHARDRUN_MAX_WORKERS": "99999999"}, "--max-workers"},
		{nil, map[string]string{"SHARDRUN_LOG_LEVEL": "loud"}, "--log-level"},
		{[]string{"--queues", queueNames(executor.MaxQueues + 1)}, nil, "--queues"},
		{nil, map[string]string{"SHARDRUN_QUEUES": queueNames(executor.MaxQueues + 1)}, "--queues"},
	} {
		var out, errOut bytes.Buffer
		env := map[string]string{"DATABASE_URL": dsn}
		for k, v := range tc.env {
			env[k] = v
		}
		code := run(tc.args, func(k string) string { return env[k] }, &out, &errOut)
		msg := strings.TrimRight(errOut.String(), "\n")
		if code != 2 || !strings.Contains(msg, tc.want) || strings.Contains(msg, "\n") {
			t.Errorf("%v %v: exit %d, %q; want exit 2 and one line naming %s", tc.args, tc.env, code, msg, tc.want)
		}
	}
}

// queueNames is a --queues of n names.
func queueNames(n int) string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("q%d", i)
	}
	return strings.Join(names, ",")
}

// --queues takes up to executor.MaxQueues queues (finding 5 of the
// hostile-input review: the idle cost grew with them, unbounded).
func TestQueuesAreBounded(t *testing.T) {
	if q, err := runner.ParseQueues(queueNames(executor.MaxQueues)); err != nil || len(q) != executor.MaxQueues {
		t.Fatalf("%d queues: %d parsed, %v", executor.MaxQueues, len(q), err)
	}
	_, err := runner.ParseQueues(queueNames(executor.MaxQueues + 1))
	if err == nil || !strings.HasPrefix(err.Error(), "--queues: ") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("%d queues: %v, want one line naming --queues", executor.MaxQueues+1, err)
	}
}

func files(m map[string]string) func(string, int) ([]byte, error) {
	return func(name string, _ int) ([]byte, error) {
		if v, ok := m[name]; ok {
			return []byte(v), nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrPermission}
	}
}

func TestSecretsFromFilesAndWarnings(t *testing.T) {
	secrets := files(map[string]string{"/run/db": "postgres://u:hunter2@127.0.0.1:1/db\n", "/run/tok": "s3cret-token\n", "/run/empty": ""})
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

	s, err := parse(nil, env(map[string]string{"DATABASE_URL_FILE": "/run/db", "SHARDRUN_ADMIN_TOKEN_FILE": "/run/tok",
		"SHARDRUN_ADMIN_ADDR": "0.0.0.0:9090"}), secrets, io.Discard)
	if err != nil || s.cfg.DatabaseURL != "postgres://u:hunter2@127.0.0.1:1/db" || s.cfg.AdminToken != "s3cret-token" || len(s.warnings) != 0 {
		t.Fatalf("secrets from files: %v %+v", err, s)
	}
	s, err = parse([]string{"--database-url", "postgres://u:hunter2@h/db", "--admin-token", "s3cret-token"}, env(nil), secrets, io.Discard)
	if err != nil || strings.Join(s.warnings, ",") != "database-url,admin-token" {
		t.Fatalf("secrets on the command line must draw warnings: %v %v", err, s.warnings)
	}
	s, err = parse([]string{"--database-url", dsn}, env(nil), secrets, io.Discard)
	if err != nil || len(s.warnings) != 0 {
		t.Fatalf("a database URL without a password is no secret: %v %v", err, s.warnings)
	}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, map[string]string{"DATABASE_URL": dsn, "DATABASE_URL_FILE": "/run/db"}, "DATABASE_URL and DATABASE_URL_FILE are both set"},
		{nil, map[string]string{"DATABASE_URL_FILE": "/run/nope"}, "DATABASE_URL_FILE: reading the secret file"},
		{nil, map[string]string{"DATABASE_URL_FILE": "/run/empty"}, "DATABASE_URL_FILE: /run/empty is empty"},
		{[]string{"--admin-token-file", "/run/nope"}, map[string]string{"DATABASE_URL": dsn}, "--admin-token-file: reading the secret file"},
		{[]string{"--database-url", "postgres://u:hunter2@h:nope/db"}, nil, "--database-url"},
		{[]string{"--database-url", "host=h password=hunter2 port=nope"}, nil, "--database-url"},
		{[]string{"--database-url", "postgres://u:hunter2@h/db", "--admin-addr", "0.0.0.0:1", "--admin-token", "s3cret token"}, nil, "--admin-token"},
	} {
		_, err := parse(tc.args, env(tc.env), secrets, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2") || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%v %v: %v; want an error with %q and no secret", tc.args, tc.env, err, tc.want)
		}
	}
}

// A secret on the command line is warned about in the log, which never
// holds it, nor does the error of a failed start.
func TestCommandLineSecretIsWarnedAboutNotLogged(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run([]string{"--database-url", "postgres://u:hunter2@127.0.0.1:1/db?connect_timeout=2", "--admin-token", "s3cret-token",
		"--etcd-endpoints", "http://127.0.0.1:1"}, func(string) string { return "" }, &out, &errOut)
	logs := errOut.String()
	if code != 1 || !strings.Contains(logs, "a secret was given on the command line") || !strings.Contains(logs, "flag=--admin-token") ||
		strings.Contains(logs, "hunter2") || strings.Contains(logs, "s3cret-token") {
		t.Fatalf("exit %d, output:\n%s", code, logs)
	}
}

// FuzzRunnerFlags feeds arguments and environment variables (lines
// "$NAME=value") to the flag layer: it never panics, refuses with one line
// naming a flag or variable, and what it accepts makes a runner.
func FuzzRunnerFlags(f *testing.F) {
	for _, s := range []string{
		"--database-url\npostgres://u@h/db", "$DATABASE_URL=postgres://u@h/db\n--max-workers\n1000000000000",
		"$DATABASE_URL=postgres://u@h/db\n--shard-count\n1000000", "--database-url-file\n/run/db\n--lease-ttl\n3s\n--detach-margin\n2s",
		"$DATABASE_URL_FILE=/run/db\n$DATABASE_URL=x", "--admin-token-file\nempty", "--help", "--etcd-endpoints\nhttp://127.0.0.1:99999",
		"$SHARDRUN_ADMIN_ADDR=0.0.0.0:9090\n$DATABASE_URL=postgres://h/db", "--detach-margin\n0", "-h=1",
	} {
		f.Add(s)
	}
	read := files(map[string]string{"/run/db": "postgres://u:pw@h/db\n", "empty": "", "/run/tok": "t0k\n"})
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
		s, err := parse(args, func(k string) string { return env[k] }, read, io.Discard)
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
		if err := s.cfg.Validate(); err != nil {
			t.Fatalf("%q: accepted, then refused: %v", in, err)
		}
		if _, err := runner.New(s.cfg); err != nil {
			t.Fatalf("%q: accepted, but no runner: %v", in, err)
		}
		if s.cfg.MaxWorkers > executor.MaxMaxWorkers || s.cfg.LeaseTTL > time.Hour {
			t.Fatalf("%q: accepted out of bounds: %+v", in, s.cfg)
		}
	})
}

// Every *-file flag (secrets, keys, certificates, the admin endpoint's TLS
// included) reads its file with a bound: /dev/zero (endless, size 0 to
// stat) and a sparse 4 GiB file each stop the runner with exit status 2
// and one line naming the flag (issue 34).
func TestEveryFileFlagIsReadWithABound(t *testing.T) {
	var help, errOut bytes.Buffer
	if code := run([]string{"--help"}, func(string) string { return "" }, &help, &errOut); code != 0 {
		t.Fatalf("--help: %d %s", code, errOut.String())
	}
	flags := regexp.MustCompile(`--([a-z-]+-file)\b`).FindAllStringSubmatch(help.String(), -1)
	if len(flags) < 7 {
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
			if code != 2 || !strings.HasPrefix(msg, "runner: --"+m[1]+": "+path+" is larger than") || strings.Contains(msg, "\n") {
				t.Errorf("--%s %s: exit %d %q; want exit 2 and one line naming the flag", m[1], path, code, msg)
			}
		}
	}
}
