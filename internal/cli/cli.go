// Package cli holds what the runner and coordinator binaries share: flags
// with environment fallbacks, the logger, and the etcd client.
package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
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

// FlagSet is a flag.FlagSet whose flags fall back to environment variables:
// a flag given on the command line wins, then its variable, then the default.
type FlagSet struct {
	fs      *flag.FlagSet
	summary string
	env     map[string]string // flag name -> variable
	order   []string
	dynamic map[string]bool // defaults computed at run time, described in the usage instead
	given   map[string]bool // set on the command line or by the environment
}

// NewFlagSet returns an empty set for the named command.
func NewFlagSet(name, summary string) *FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return &FlagSet{fs: fs, summary: summary, env: map[string]string{}, dynamic: map[string]bool{}, given: map[string]bool{}}
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
	f.fs.Visit(func(fl *flag.Flag) { f.given[fl.Name] = true })
	for _, name := range f.order {
		env := f.env[name]
		if f.given[name] || env == "" {
			continue
		}
		if v, ok := lookup(getenv, env); ok {
			if err := f.fs.Set(name, v); err != nil {
				return fmt.Errorf("invalid value %q for %s (--%s): %v", v, env, name, err)
			}
			f.given[name] = true
		}
	}
	return nil
}

// Given reports whether the flag was set on the command line or by its
// environment variable (after Parse): a mode that brings its own defaults
// (--dev) changes only the flags the user did not give.
func (f *FlagSet) Given(name string) bool { return f.given[name] }

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

// NewLogger returns the root hclog logger. level is trace, debug, info,
// warn or error; format is text or json.
func NewLogger(name, level, format string, w io.Writer) (hclog.Logger, error) {
	lvl := hclog.LevelFromString(level)
	if lvl == hclog.NoLevel {
		return nil, fmt.Errorf("--log-level: must be trace, debug, info, warn or error, got %q", level)
	}
	if format != "text" && format != "json" {
		return nil, fmt.Errorf("--log-format: must be text or json, got %q", format)
	}
	return hclog.New(&hclog.LoggerOptions{Name: name, Level: lvl, JSONFormat: format == "json", Output: w}), nil
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

// CheckEndpoints validates etcd client URLs.
func CheckEndpoints(endpoints []string) error {
	if len(endpoints) == 0 {
		return fmt.Errorf("--etcd-endpoints: at least one endpoint is required")
	}
	for _, e := range endpoints {
		u, err := url.Parse(e)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("--etcd-endpoints: %q is not an http(s)://host:port URL", e)
		}
		if _, err := strconv.Atoi(u.Port()); err != nil {
			return fmt.Errorf("--etcd-endpoints: %q has no port", e)
		}
	}
	return nil
}

// NewEtcdClient returns a client with gRPC keep-alives, so that a dead or
// partitioned connection is noticed within seconds rather than when TCP
// gives up. It does not connect until used.
func NewEtcdClient(endpoints []string) (*clientv3.Client, error) {
	if err := CheckEndpoints(endpoints); err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
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
