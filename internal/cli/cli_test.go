package cli

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func secretSet(files map[string]string) (*FlagSet, *string) {
	f := NewFlagSet("t", "")
	var token string
	f.Secret(&token, "admin-token", "SHARDRUN_ADMIN_TOKEN", "a token")
	f.ReadFile = func(name string, _ int) ([]byte, error) {
		if v, ok := files[name]; ok {
			return []byte(v), nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	return f, &token
}

func TestSecretFromFile(t *testing.T) {
	files := map[string]string{"/run/tok": "s3cret\n", "/run/crlf": "s3cret\r\n", "/run/two": "s3cret\n\n",
		"/run/empty": "", "/run/newline": "\n", "/run/big": strings.Repeat("x", MaxSecretFile+1)}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string // the value, or the error's text
		err  bool
	}{
		{[]string{"--admin-token-file", "/run/tok"}, nil, "s3cret", false},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/tok"}, "s3cret", false},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/crlf"}, "s3cret", false},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/two"}, "s3cret\n", false}, // one newline only
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN": "direct"}, "direct", false},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN": "direct", "SHARDRUN_ADMIN_TOKEN_FILE": "/run/tok"}, "SHARDRUN_ADMIN_TOKEN and SHARDRUN_ADMIN_TOKEN_FILE are both set", true},
		{[]string{"--admin-token", "x"}, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/tok"}, "--admin-token and SHARDRUN_ADMIN_TOKEN_FILE are both set", true},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/missing"}, "SHARDRUN_ADMIN_TOKEN_FILE: reading the secret file", true},
		{[]string{"--admin-token-file", "/run/missing"}, nil, "--admin-token-file: reading the secret file", true},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/empty"}, "SHARDRUN_ADMIN_TOKEN_FILE: /run/empty is empty", true},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/newline"}, "is empty", true},
		{nil, map[string]string{"SHARDRUN_ADMIN_TOKEN_FILE": "/run/big"}, "not a secret file", true},
	} {
		f, token := secretSet(files)
		err := f.Parse(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
		switch {
		case tc.err && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v %v: %v, want an error with %q", tc.args, tc.env, err, tc.want)
		case tc.err && strings.Contains(err.Error(), "s3cret"):
			t.Errorf("%v %v: the error shows the secret: %v", tc.args, tc.env, err)
		case !tc.err && (err != nil || *token != tc.want):
			t.Errorf("%v %v: %q %v, want %q", tc.args, tc.env, *token, err, tc.want)
		}
	}
}

func TestSecretsOnCommandLine(t *testing.T) {
	f, _ := secretSet(map[string]string{"/run/tok": "t"})
	if err := f.Parse([]string{"--admin-token", "t"}, func(string) string { return "" }, io.Discard); err != nil {
		t.Fatal(err)
	}
	if got := f.SecretsOnCommandLine(); len(got) != 1 || got[0] != "admin-token" {
		t.Errorf("on the command line: %v", got)
	}
	for _, args := range [][]string{nil, {"--admin-token-file", "/run/tok"}} {
		f, _ := secretSet(map[string]string{"/run/tok": "t"})
		if err := f.Parse(args, func(k string) string { return map[string]string{"SHARDRUN_ADMIN_TOKEN": "t"}[k] }, io.Discard); err != nil && args == nil {
			t.Fatal(err)
		}
		if got := f.SecretsOnCommandLine(); len(got) != 0 {
			t.Errorf("%v: %v, want no warning for the environment or a file", args, got)
		}
	}
}

func TestCheckEndpoints(t *testing.T) {
	for _, ok := range [][]string{{"http://127.0.0.1:2379"}, {"https://etcd-0.etcd:2379/", "http://[::1]:2379"}} {
		if err := CheckEndpoints(ok); err != nil {
			t.Errorf("%v: %v", ok, err)
		}
	}
	for _, bad := range []string{"127.0.0.1:2379", "http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1",
		"http://127.0.0.1:+1", "unix:///tmp/etcd", "http://127.0.0.1:2379/v3", "http://127.0.0.1:2379?x=1", "ftp://h:1"} {
		if err := CheckEndpoints([]string{bad}); err == nil || !strings.HasPrefix(err.Error(), "--etcd-endpoints: ") {
			t.Errorf("%q: %v", bad, err)
		}
	}
	if err := CheckEndpoints([]string{"http://root:hunter2@127.0.0.1:2379"}); err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("an endpoint with a password: %v", err)
	}
	if err := CheckEndpoints(make([]string, MaxEndpoints+1)); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Errorf("too many endpoints: %v", err)
	}
}

func TestCheckListenAddr(t *testing.T) {
	for addr, host := range map[string]string{"127.0.0.1:0": "127.0.0.1", ":9090": "", "[::1]:65535": "::1", "localhost:8080": "localhost"} {
		if h, err := CheckListenAddr("--admin-addr", addr); err != nil || h != host {
			t.Errorf("%q: %q %v", addr, h, err)
		}
	}
	for _, addr := range []string{"nonsense", "127.0.0.1:99999", "127.0.0.1:-1", "127.0.0.1:http", "127.0.0.1:"} {
		if _, err := CheckListenAddr("--admin-addr", addr); err == nil || !strings.HasPrefix(err.Error(), "--admin-addr: ") {
			t.Errorf("%q: %v", addr, err)
		}
	}
	if !IsLoopback("localhost") || !IsLoopback("::1") || IsLoopback("") || IsLoopback("0.0.0.0") {
		t.Error("IsLoopback")
	}
}

func TestGivenZeroIsGiven(t *testing.T) {
	f := NewFlagSet("t", "")
	var n int
	f.Int(&n, "sweep-batch", "SHARDRUN_SWEEP_BATCH", 1000, "")
	if err := f.Parse([]string{"--sweep-batch", "0"}, func(string) string { return "" }, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !f.Given("sweep-batch") || n != 0 || f.Source("sweep-batch") != "--sweep-batch" {
		t.Fatalf("given %v, value %d, source %q", f.Given("sweep-batch"), n, f.Source("sweep-batch"))
	}
	err := NewFlagSet("t", "").Parse([]string{"--nope"}, nil, io.Discard)
	if err == nil || errors.Is(err, ErrHelp) {
		t.Fatal(err)
	}
}

// endlessFiles are files os.ReadFile would read to exhaustion: /dev/zero,
// which never ends and which stat gives as size 0, and a sparse file of
// 4 GiB (it costs no disk), whose size os.ReadFile would allocate.
func endlessFiles(t *testing.T) []string {
	t.Helper()
	sparse := filepath.Join(t.TempDir(), "sparse")
	if err := os.WriteFile(sparse, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(sparse, 4<<30); err != nil {
		t.Fatal(err)
	}
	return []string{"/dev/zero", sparse}
}

// Every kind of file flag (a secret, a private key, a certificate) reads
// its file with a bound, and a file over it is one line naming the flag
// (issue 34: --http-key-file /dev/zero ran the coordinator out of memory).
func TestFlagFilesAreReadWithABound(t *testing.T) {
	for _, path := range endlessFiles(t) {
		for _, tc := range []struct {
			flag, env string
			limit     int
		}{
			{"api-token", "SHARDRUN_API_TOKEN", MaxSecretFile},
			{"etcd-key", "SHARDRUN_ETCD_KEY", MaxSecretFile},
			{"etcd-ca", "SHARDRUN_ETCD_CA", MaxPEMFile},
			{"etcd-cert", "SHARDRUN_ETCD_CERT", MaxPEMFile},
		} {
			for _, by := range []string{"--" + tc.flag + "-file", tc.env + "_FILE"} {
				f := NewFlagSet("t", "")
				var token, ca, cert, key string
				f.Secret(&token, "api-token", "SHARDRUN_API_TOKEN", "a token")
				f.EtcdTLSFlags(&ca, &cert, &key)
				var args []string
				env := map[string]string{}
				if strings.HasPrefix(by, "--") {
					args = []string{by, path}
				} else {
					env[by] = path
				}
				err := f.Parse(args, func(k string) string { return env[k] }, io.Discard)
				want := fmt.Sprintf("%s: %s is larger than %d bytes", by, path, tc.limit)
				if err == nil || !strings.HasPrefix(err.Error(), want) || !strings.Contains(err.Error(), "(--"+tc.flag+")") || strings.Contains(err.Error(), "\n") {
					t.Errorf("%s %s: %v, want one line starting %q", by, path, err, want)
				}
			}
		}
	}
}

// ReadFileLimited reads limit+1 bytes at most, and a short file whole.
func TestReadFileLimited(t *testing.T) {
	for _, path := range endlessFiles(t) {
		if b, err := ReadFileLimited(path, 10); err != nil || len(b) != 11 {
			t.Errorf("%s: %d bytes, %v; want 11", path, len(b), err)
		}
	}
	short := filepath.Join(t.TempDir(), "short")
	if err := os.WriteFile(short, []byte("tok\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFileLimited(short, 10); err != nil || string(b) != "tok\n" {
		t.Errorf("a short file: %q %v", b, err)
	}
}
