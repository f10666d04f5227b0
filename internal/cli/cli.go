// Package cli holds what the runner and coordinator binaries share: flags
// with environment fallbacks, the logger, and the etcd client.
package cli

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/hashicorp/go-hclog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// DefaultEtcdAddr is the default etcd client address: what the binaries
// connect to, and where the coordinator's embedded etcd listens.
const DefaultEtcdAddr = "127.0.0.1:2379"

// DefaultEtcdEndpoints is the default of --etcd-endpoints.
const DefaultEtcdEndpoints = "http://" + DefaultEtcdAddr

// MaxSecretFile bounds a secret file: a token, a database URL or a PEM
// private key (an RSA 4096 key is about 3.3 KB) is short, and a large
// file is the wrong file.
const MaxSecretFile = 64 << 10

// FlagSet is a flag.FlagSet whose flags fall back to environment variables:
// a flag given on the command line wins, then its variable, then the default.
type FlagSet struct {
	fs      *flag.FlagSet
	summary string
	env     map[string]string // flag name -> variable
	order   []string
	dynamic map[string]bool   // defaults computed at run time, described in the usage instead
	source  map[string]string // flag name -> where its value came from (--flag or VARIABLE), when given
	secrets []secret
	// dbs are the databases' flags, when declared (Databases).
	dbs *databases
	// ReadFile reads a secret or PEM file, at most limit+1 bytes: enough
	// to tell a file over its limit without reading the rest. Default
	// ReadFileLimited (tests replace it).
	ReadFile func(name string, limit int) ([]byte, error)
}

// secret is a flag whose value may instead come from a file (Secret,
// PEM). Only real secrets are warned about on the command line.
type secret struct {
	p      *string
	name   string
	limit  int
	secret bool
}

// NewFlagSet returns an empty set for the named command.
func NewFlagSet(name, summary string) *FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return &FlagSet{fs: fs, summary: summary, env: map[string]string{}, dynamic: map[string]bool{},
		source: map[string]string{}, ReadFile: ReadFileLimited}
}

// ReadFileLimited reads at most limit+1 bytes of the named file, so that
// what a flag's file costs is bounded by its limit, whatever the file:
// os.ReadFile reads to the end, which /dev/zero never reaches (and whose
// size stat gives as 0), and sizes its buffer by what stat says, which for
// a sparse file can be gigabytes of nothing. A result longer than limit
// means the file is over it.
func ReadFileLimited(name string, limit int) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, int64(limit)+1))
}

// DynamicDefault marks a flag whose default is computed at run time (such
// as hostname-pid); its usage text describes it and no value is printed.
func (f *FlagSet) DynamicDefault(name string) { f.dynamic[name] = true }

func (f *FlagSet) add(name, env string) {
	f.env[name] = env
	f.order = append(f.order, name)
}

// String defines a string flag.
func (f *FlagSet) String(p *string, name, env, def, usage string) {
	f.fs.StringVar(p, name, def, usage)
	f.add(name, env)
}

// Int defines an int flag.
func (f *FlagSet) Int(p *int, name, env string, def int, usage string) {
	f.fs.IntVar(p, name, def, usage)
	f.add(name, env)
}

// Duration defines a duration flag (Go syntax: 500ms, 10s, 1m).
func (f *FlagSet) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	f.fs.DurationVar(p, name, def, usage)
	f.add(name, env)
}

// Secret defines a string flag holding a secret (a token, a database URL)
// and its file form: --<name>-file and <env>_FILE name a file holding the
// value, for container platforms that mount secrets as files and because a
// value on the command line is readable by every local user in
// /proc/<pid>/cmdline. Parse reads the file (one trailing newline is
// trimmed) and refuses an unreadable or empty file, and a value given both
// ways.
func (f *FlagSet) Secret(p *string, name, env, usage string) {
	f.valueOrFile(p, name, env, usage, secret{limit: MaxSecretFile, secret: true})
}

// MaxPEMFile bounds a certificate file (--etcd-ca-file and the like): a
// chain is a few KB, and a whole CA bundle fits several times over (the
// system's 144 roots are 215 KiB), while what a wrong file (a disk image,
// /dev/zero) costs stays a megabyte.
const MaxPEMFile = 1 << 20

// PEM defines a flag holding PEM (a CA or a certificate, not secret) and
// its file form, --<name>-file and <env>_FILE, read as Secret reads its
// file.
func (f *FlagSet) PEM(p *string, name, env, usage string) {
	f.valueOrFile(p, name, env, usage, secret{limit: MaxPEMFile})
}

func (f *FlagSet) valueOrFile(p *string, name, env, usage string, s secret) {
	f.String(p, name, env, "", usage)
	var file string
	f.String(&file, name+"-file", env+"_FILE", "", "file holding --"+name+" (one trailing newline is trimmed)")
	s.p, s.name = p, name
	f.secrets = append(f.secrets, s)
}

// Bool defines a boolean flag.
func (f *FlagSet) Bool(p *bool, name, env string, def bool, usage string) {
	f.fs.BoolVar(p, name, def, usage)
	f.add(name, env)
}

// ErrHelp is returned by Parse for -h/--help, after the usage was printed.
var ErrHelp = flag.ErrHelp

// Parse parses args, then fills every flag not given on the command line
// from its environment variable. Errors name the flag and, when it came
// from there, the variable.
func (f *FlagSet) Parse(args []string, getenv func(string) string, out io.Writer) error {
	if err := f.fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			f.Usage(out)
			return ErrHelp
		}
		return fmt.Errorf("%s (see --help)", strings.Replace(err.Error(), " -", " --", 1))
	}
	if f.fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q (see --help)", f.fs.Arg(0))
	}
	f.fs.Visit(func(fl *flag.Flag) { f.source[fl.Name] = "--" + fl.Name })
	for _, name := range f.order {
		env := f.env[name]
		if f.source[name] != "" || env == "" || name == DatabaseFlag || name == DatabaseFileFlag {
			continue // the databases' variables are read together (parseDatabases)
		}
		if v, ok := lookup(getenv, env); ok {
			if err := f.fs.Set(name, v); err != nil {
				if f.isSecret(name) {
					v = "…" // never echo a secret
				}
				return fmt.Errorf("invalid value %q for %s (--%s): %v", v, env, name, err)
			}
			f.source[name] = env
		}
	}
	for _, s := range f.secrets {
		if err := f.readSecret(s); err != nil {
			return err
		}
	}
	return f.parseDatabases(getenv)
}

func (f *FlagSet) isSecret(name string) bool {
	for _, s := range f.secrets {
		if s.name == name && s.secret {
			return true
		}
	}
	return false
}

// readSecret fills a secret from its file when the file form was given.
func (f *FlagSet) readSecret(s secret) error {
	fileFlag := s.name + "-file"
	from := f.source[fileFlag]
	if from == "" {
		return nil
	}
	if by := f.source[s.name]; by != "" {
		return fmt.Errorf("%s and %s are both set: give the secret one way", by, from)
	}
	path := f.fs.Lookup(fileFlag).Value.String()
	if path == "" {
		return fmt.Errorf("%s: empty file name", from)
	}
	kind := "certificate"
	if s.secret {
		kind = "secret"
	}
	b, err := f.ReadFile(path, s.limit)
	if err != nil {
		return fmt.Errorf("%s: reading the %s file: %v", from, kind, err)
	}
	if len(b) > s.limit {
		return fmt.Errorf("%s: %s is larger than %d bytes: not a %s file (--%s)", from, path, s.limit, kind, s.name)
	}
	v := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if v == "" {
		return fmt.Errorf("%s: %s is empty", from, path)
	}
	*s.p = v
	f.source[s.name] = from
	return nil
}

// Given reports whether the flag was set on the command line, by its
// environment variable or (for a secret) through its file, after Parse: a
// mode that brings its own defaults (--dev) changes only the flags the user
// did not give.
func (f *FlagSet) Given(name string) bool { return f.source[name] != "" }

// SecretsOnCommandLine lists the secret flags whose value was given on the
// command line itself, to warn about: /proc/<pid>/cmdline is readable by
// every local user, the environment (/proc/<pid>/environ) and a file
// readable by the owner only are not.
func (f *FlagSet) SecretsOnCommandLine() []string {
	var names []string
	for _, s := range f.secrets {
		if s.secret && f.source[s.name] == "--"+s.name {
			names = append(names, s.name)
		}
	}
	return names
}

// Source says where a given flag's value came from: "--name", the
// variable, or the secret file's flag or variable; "" when not given.
func (f *FlagSet) Source(name string) string { return f.source[name] }

func lookup(getenv func(string) string, name string) (string, bool) {
	if getenv == nil {
		return os.LookupEnv(name)
	}
	v := getenv(name)
	return v, v != ""
}

// Usage prints the summary and every flag with its variable and default.
func (f *FlagSet) Usage(w io.Writer) {
	fmt.Fprintf(w, "%s\n\nFlags (each can also be set by the environment variable shown):\n\n", f.summary)
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	names := append([]string(nil), f.order...)
	sort.Strings(names)
	for _, name := range names {
		fl := f.fs.Lookup(name)
		def := ""
		if fl.DefValue != "" && !f.dynamic[name] {
			def = " (default " + fl.DefValue + ")"
		}
		env := f.env[name]
		if env == "" {
			env = "-"
		}
		fmt.Fprintf(tw, "  --%s\t%s\t%s%s\n", name, env, fl.Usage, def)
	}
	tw.Flush()
}

// LogFlags declares --log-level and --log-format, the two flags NewLogger
// takes, the same way for every binary.
func (f *FlagSet) LogFlags(level, format *string) {
	f.String(level, "log-level", "SHARDRUN_LOG_LEVEL", "info", "trace, debug, info, warn or error")
	f.String(format, "log-format", "SHARDRUN_LOG_FORMAT", "text", "text or json")
}

// CheckLogFlags validates --log-level and --log-format.
func CheckLogFlags(level, format string) error {
	if hclog.LevelFromString(level) == hclog.NoLevel {
		return fmt.Errorf("--log-level: must be trace, debug, info, warn or error, got %q", level)
	}
	if format != "text" && format != "json" {
		return fmt.Errorf("--log-format: must be text or json, got %q", format)
	}
	return nil
}

// NewLogger returns the root hclog logger. level is trace, debug, info,
// warn or error; format is text or json.
func NewLogger(name, level, format string, w io.Writer) (hclog.Logger, error) {
	if err := CheckLogFlags(level, format); err != nil {
		return nil, err
	}
	return hclog.New(&hclog.LoggerOptions{Name: name, Level: hclog.LevelFromString(level), JSONFormat: format == "json", Output: w}), nil
}

// SplitList splits a comma-separated flag value, dropping empty items.
func SplitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// MaxEndpoints bounds --etcd-endpoints: an etcd cluster has an odd
// handful of members (etcd advises at most 7).
const MaxEndpoints = 16

// CheckEndpoints validates etcd client URLs: http or https, a host and a
// port from 1 to 65535, nothing else (no user, path or query: etcd's
// client ignores them, and a user's password would end up in messages).
func CheckEndpoints(endpoints []string) error {
	if len(endpoints) == 0 {
		return fmt.Errorf("--etcd-endpoints: at least one endpoint is required")
	}
	if len(endpoints) > MaxEndpoints {
		return fmt.Errorf("--etcd-endpoints: at most %d endpoints (an etcd cluster has a handful of members), got %d", MaxEndpoints, len(endpoints))
	}
	for _, e := range endpoints {
		u, err := url.Parse(e)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil ||
			(u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
			return fmt.Errorf("--etcd-endpoints: %s is not an http(s)://host:port URL", quoteEndpoint(e))
		}
		if _, err := Port(u.Port(), false); err != nil {
			return fmt.Errorf("--etcd-endpoints: %s: %v", quoteEndpoint(e), err)
		}
	}
	return nil
}

// quoteEndpoint quotes an endpoint for a message without a user's password.
func quoteEndpoint(e string) string {
	if u, err := url.Parse(e); err == nil && u.User != nil {
		u.User = url.User("…")
		e = u.String()
	} else if i := strings.LastIndex(e, "@"); i >= 0 {
		e = "…" + e[i:]
	}
	if len(e) > 100 {
		e = e[:100] + "…"
	}
	return strconv.Quote(e)
}

// Port parses a TCP port number: 1 to 65535, or 0 (any free port) when
// allowZero.
func Port(s string, allowZero bool) (int, error) {
	if s == "" {
		return 0, fmt.Errorf("no port")
	}
	n, err := strconv.Atoi(s)
	if err != nil || s[0] == '+' || s[0] == '-' || n > 65535 || n < 0 || (n == 0 && !allowZero) {
		lo := 1
		if allowZero {
			lo = 0
		}
		return 0, fmt.Errorf("port %q is not a number from %d to 65535", s, lo)
	}
	return n, nil
}

// CheckListenAddr validates a host:port to listen on (port 0 picks a free
// one) and returns the host.
func CheckListenAddr(flagName, addr string) (host string, err error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("%s: must be host:port, got %q", flagName, addr)
	}
	if _, err := Port(port, true); err != nil {
		return "", fmt.Errorf("%s: %q: %v", flagName, addr, err)
	}
	return host, nil
}

// IsLoopback reports whether host (from a listen address) only accepts
// local connections. An empty host listens on every interface.
func IsLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// NewEtcdClient returns a client with gRPC keep-alives, so that a dead or
// partitioned connection is noticed within seconds rather than when TCP
// gives up, and with tlsConfig (nil: none; see TLS.Client). It does not
// connect until used.
func NewEtcdClient(endpoints []string, tlsConfig *tls.Config) (*clientv3.Client, error) {
	if err := CheckEndpoints(endpoints); err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
		TLS:                  tlsConfig,
		Endpoints:            endpoints,
		DialTimeout:          5 * time.Second,
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		Logger:               zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("--etcd-endpoints: creating etcd client for %v: %w", endpoints, err)
	}
	return cli, nil
}

// OneLine flattens an error message for the "one line saying what and which
// flag" rule of the binaries.
func OneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// SignalContext returns a context cancelled by the first SIGINT or SIGTERM,
// which starts a graceful shutdown; a second signal exits the process at
// once with status 1.
func SignalContext(log hclog.Logger) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case s := <-ch:
			log.Info("signal received: shutting down gracefully (send it again to exit at once)", "signal", s.String())
			cancel()
		case <-done:
			return
		}
		select {
		case s := <-ch:
			log.Warn("second signal: exiting at once", "signal", s.String())
			os.Exit(1)
		case <-done:
		}
	}()
	return ctx, func() {
		signal.Stop(ch)
		close(done)
		cancel()
	}
}
