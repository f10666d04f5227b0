// Package pgtmp runs a throwaway PostgreSQL server from the binaries installed
// on the machine. Tests, the demo and the benchmarks use it so that nothing
// needs a database set up by hand.
//
// The server lives in a fresh temporary directory, listens on a free loopback
// port, and is stopped and removed by Stop. PostgreSQL refuses to run as root,
// so when the process is root the server runs as the unprivileged user
// "nobody". The server gets SIGINT if this process dies, and directories left
// by processes that died without cleaning up are removed by the next Start.
package pgtmp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/internal/freeport"
	"github.com/shardrun/shardrun/internal/linewriter"
	"github.com/shardrun/shardrun/internal/tempdir"
)

// dirPrefix names the temporary directories so stale ones can be found.
const dirPrefix = "shardrun-pg-"

// InstallHint is appended to every error about missing or unusable binaries.
const InstallHint = "install the PostgreSQL server binaries (Debian: apt-get install postgresql) " +
	"or set TEST_DATABASE_URL to a server whose user may CREATE DATABASE"

// Options tune the server. The zero value is a fast, non-durable server for tests.
type Options struct {
	// Durable keeps fsync and synchronous_commit on; benchmarks that compare
	// systems set it so that numbers reflect a real deployment.
	Durable bool
	// MaxConnections defaults to 300: tests run many pools in one server.
	MaxConnections int
	// Settings are extra "-c name=value" server settings.
	Settings map[string]string
	// Log receives the server's stderr; nil discards it.
	Log func(line string)
	// TLS, when set, makes the server take TLS connections (ssl=on) with
	// this PEM certificate and key; plain connections are still accepted
	// (DSN), and TLSDSN asks for verify-full.
	TLS *TLS
}

// TLS is a server certificate and its key, in PEM.
type TLS struct {
	Cert, Key []byte
}

// Server is a running throwaway PostgreSQL.
type Server struct {
	dir     string
	port    int
	bin     string
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error
	opts    Options

	stopOnce sync.Once
	stopErr  error
}

// FindBinaries returns the directory holding initdb and postgres: PATH first,
// then the newest /usr/lib/postgresql/*/bin.
func FindBinaries() (string, error) {
	if p, err := exec.LookPath("postgres"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "postgres")); err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", fmt.Errorf("PostgreSQL binaries initdb and postgres not found on PATH or in /usr/lib/postgresql/*/bin: %s", InstallHint)
}

// RemoveStale removes the directories of servers started by processes that
// are gone (killed before they could stop their server), and returns them.
// A directory whose server still runs (it is shutting down after its
// owner's death) is left for the next call.
func RemoveStale() []string {
	return tempdir.RemoveStale(dirPrefix, func(dir string) bool {
		b, err := os.ReadFile(filepath.Join(dir, "data", "postmaster.pid"))
		if err != nil {
			return false
		}
		pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
		return err == nil && tempdir.Owner{Pid: pid}.Alive()
	})
}

func versionOf(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

// Start initialises a data directory and starts the server, returning once it
// accepts connections.
func Start(ctx context.Context, opts Options) (*Server, error) {
	bin, err := FindBinaries()
	if err != nil {
		return nil, err
	}
	cred, err := credential()
	if err != nil {
		return nil, err
	}
	RemoveStale()
	dir, err := tempdir.NewOwnedBy("", dirPrefix, tempdir.Self())
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir, bin: bin, opts: opts, exited: make(chan struct{})}
	data := filepath.Join(dir, "data")
	if cred != nil {
		if err := os.Chmod(dir, 0o755); err != nil {
			s.cleanup()
			return nil, fmt.Errorf("opening data directory to the server user: %w", err)
		}
		if err := os.Mkdir(data, 0o700); err != nil {
			s.cleanup()
			return nil, fmt.Errorf("creating data directory: %w", err)
		}
		if err := os.Chown(data, int(cred.Uid), int(cred.Gid)); err != nil {
			s.cleanup()
			return nil, fmt.Errorf("handing data directory to the server user: %w", err)
		}
	}
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		s.cleanup()
		return nil, fmt.Errorf("running initdb in %s: %w: %s (%s)", data, err, strings.TrimSpace(linewriter.Tail(string(out), 5)), InstallHint)
	}
	if err := s.writeTLS(data, cred); err != nil {
		s.cleanup()
		return nil, err
	}
	for attempt := 0; ; attempt++ {
		port, err := freeport.Port()
		if err != nil {
			s.cleanup()
			return nil, err
		}
		err = s.launch(ctx, data, cred, port)
		if err == nil {
			return s, nil
		}
		if attempt >= 3 || ctx.Err() != nil {
			s.cleanup()
			return nil, err
		}
		// Another process may have taken the port between probing and binding.
	}
}

// writeTLS puts the TLS certificate and key into the data directory,
// owned by the server's user and readable by it only (PostgreSQL refuses a
// key others can read), and turns ssl on.
func (s *Server) writeTLS(data string, cred *syscall.Credential) error {
	if s.opts.TLS == nil {
		return nil
	}
	for name, b := range map[string][]byte{"server.crt": s.opts.TLS.Cert, "server.key": s.opts.TLS.Key} {
		path := filepath.Join(data, name)
		if err := os.WriteFile(path, b, 0o600); err != nil {
			return fmt.Errorf("writing %s: %w", name, err)
		}
		if cred != nil {
			if err := os.Chown(path, int(cred.Uid), int(cred.Gid)); err != nil {
				return fmt.Errorf("handing %s to the server user: %w", name, err)
			}
		}
	}
	settings := map[string]string{"ssl": "on", "ssl_cert_file": "server.crt", "ssl_key_file": "server.key"}
	for k, v := range s.opts.Settings {
		settings[k] = v
	}
	s.opts.Settings = settings
	return nil
}

// TLSDSN is the DSN of database over TLS with sslmode=verify-full: the
// server's certificate must be signed by the CA in the PEM file rootCert
// and name 127.0.0.1.
func (s *Server) TLSDSN(database, rootCert string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=verify-full&sslrootcert=%s", s.port, database, url.QueryEscape(rootCert))
}

func (s *Server) launch(ctx context.Context, data string, cred *syscall.Credential, port int) error {
	s.port = port
	args := []string{"-D", data, "-p", strconv.Itoa(port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=",
		"-c", "max_connections=" + strconv.Itoa(cmp.Or(s.opts.MaxConnections, 300)),
		"-c", "log_min_messages=warning",
	}
	if !s.opts.Durable {
		args = append(args, "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
	}
	keys := make([]string, 0, len(s.opts.Settings))
	for k := range s.opts.Settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		args = append(args, "-c", k+"="+s.opts.Settings[k])
	}
	var logW *linewriter.Writer
	if s.opts.Log != nil {
		logW = linewriter.New(s.opts.Log)
	}
	started := make(chan error, 1)
	s.exited = make(chan struct{})
	go func() {
		// Pdeathsig is tied to the thread that forks: keep this goroutine on
		// its thread until the server exits so the signal fires only when the
		// whole process dies.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		cmd := exec.Command(filepath.Join(s.bin, "postgres"), args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGINT, Setpgid: true}
		if logW != nil {
			cmd.Stderr = logW
			cmd.Stdout = logW
		}
		if err := cmd.Start(); err != nil {
			started <- fmt.Errorf("starting postgres: %w", err)
			close(s.exited)
			return
		}
		s.cmd = cmd
		started <- nil
		s.waitErr = cmd.Wait()
		close(s.exited)
	}()
	if err := <-started; err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		conn, err := pgx.Connect(cctx, s.DSN("postgres"))
		cancel()
		if err == nil {
			_ = conn.Close(context.Background())
			return nil
		}
		select {
		case <-s.exited:
			return fmt.Errorf("postgres exited during startup on port %d: %v", s.port, s.waitErr)
		default:
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			_ = s.signalStop()
			return fmt.Errorf("postgres on port %d did not accept connections: %w", s.port, err)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// DSN returns a connection string for the named database.
func (s *Server) DSN(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.port, database)
}

// Port is the server's TCP port on 127.0.0.1.
func (s *Server) Port() int { return s.port }

// Dir is the temporary directory holding the data directory.
func (s *Server) Dir() string { return s.dir }

// CreateDatabase creates an empty database and returns its DSN.
func (s *Server) CreateDatabase(ctx context.Context, name string) (string, error) {
	return CreateDatabase(ctx, s.DSN("postgres"), name)
}

// Restart stops the server and starts it again on the same port and data,
// simulating a database restart under load.
func (s *Server) Restart(ctx context.Context, downFor time.Duration) error {
	if err := s.Halt(); err != nil {
		return err
	}
	time.Sleep(downFor)
	return s.Resume(ctx)
}

// Halt stops the server (fast shutdown) and keeps its data: a database
// that is down until Resume.
func (s *Server) Halt() error { return s.signalStop() }

// Resume starts a halted server again on the same port and data, so that
// clients reconnect to the same address.
func (s *Server) Resume(ctx context.Context) error {
	cred, err := credential()
	if err != nil {
		return err
	}
	return s.launch(ctx, filepath.Join(s.dir, "data"), cred, s.port)
}

// Stop shuts the server down (fast shutdown) and removes its directory.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		s.stopErr = s.signalStop()
		s.cleanup()
	})
	return s.stopErr
}

func (s *Server) signalStop() error {
	if s.cmd == nil || s.cmd.Process == nil {
		return nil
	}
	select {
	case <-s.exited:
		return nil
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.exited:
		return nil
	case <-time.After(15 * time.Second):
	}
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.exited
	return errors.New("postgres did not stop on SIGINT within 15s; killed it")
}

func (s *Server) cleanup() {
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
	}
}

// CreateDatabase creates database name on the server behind adminDSN and
// returns the DSN of the new database.
func CreateDatabase(ctx context.Context, adminDSN, name string) (string, error) {
	conn, err := pgx.Connect(ctx, adminDSN)
	if err != nil {
		return "", fmt.Errorf("connecting to create database %s: %w", name, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("creating database %s: %w", name, err)
	}
	cfg, err := pgx.ParseConfig(adminDSN)
	if err != nil {
		return "", fmt.Errorf("parsing admin DSN: %w", err)
	}
	cfg.Database = name
	return configDSN(cfg), nil
}

func configDSN(cfg *pgx.ConnConfig) string {
	u := "postgres://" + cfg.User
	if cfg.Password != "" {
		u += ":" + cfg.Password
	}
	return fmt.Sprintf("%s@%s/%s?sslmode=disable", u, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), cfg.Database)
}

// credential returns the identity to run the server as: nil when this process
// is not root, "nobody" otherwise.
func credential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("nobody")
	if err != nil {
		return nil, fmt.Errorf("running as root and PostgreSQL refuses root, but user nobody does not exist to run it: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}
