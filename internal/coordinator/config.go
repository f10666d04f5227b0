package coordinator

import (
	"cmp"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"

	"github.com/shardrun/shardrun/internal/cli"
	"github.com/shardrun/shardrun/internal/clock"
	"github.com/shardrun/shardrun/internal/leadership"
	"github.com/shardrun/shardrun/internal/maintenance"
	"github.com/shardrun/shardrun/store"
	"github.com/shardrun/shardrun/sweeper"
)

// Defaults of Config.
const (
	// DefaultElectionTTL is the default leader session TTL.
	DefaultElectionTTL = leadership.DefaultElectionTTL
	// DefaultHTTPAddr serves the API and the status page.
	DefaultHTTPAddr = "127.0.0.1:8080"
)

// Config configures a Coordinator.
type Config struct {
	// ID names this coordinator in the election; required.
	ID string
	// Client talks to etcd; required.
	Client *clientv3.Client
	// Prefix is the cluster's key prefix, e.g. "/shardrun/default/".
	Prefix string
	// ShardCount must match the cluster's (meta/shard-count).
	ShardCount int
	// Router is the cluster's databases, joined to the cluster's map
	// (placement.Join: cmd/coordinator opens, migrates and joins them,
	// creating the cluster with them when it is new); the API reads and
	// writes through it, merged across the databases and routed by each
	// task's shard. Store is the one-database form.
	Router *store.Router
	// Store, when Router is nil, is the cluster's one database, main,
	// which Run joins to the cluster. One of them is required.
	Store *store.Store
	// ElectionTTL is the leader session's TTL, whole seconds: a leader that
	// dies is replaced within about this long. Default 10s.
	ElectionTTL time.Duration
	// Sweep is the settings of the leader's sweeps.
	Sweep sweeper.Config
	// Retention is the settings of the leader's deletion of finished
	// tasks; it runs unless both retentions are 0 (kept forever).
	Retention maintenance.RetentionConfig
	// Unhandled is the settings of the rule that fails ready tasks of
	// kinds no attached runner handles; it runs only when After
	// (--unhandled-after) is set.
	Unhandled maintenance.ReaperConfig
	// HTTPAddr serves the API and status page. Default DefaultHTTPAddr.
	HTTPAddr string
	// APIToken, when set, is required as a bearer token on every call that
	// reads task data or changes anything; required when HTTPAddr is not a
	// loopback address.
	APIToken string
	// HTTPCert and HTTPKey are PEM: with them the API and the status page
	// are served over HTTPS (--http-cert, --http-key).
	HTTPCert, HTTPKey string
	// MaxAttempts for enqueued tasks that do not set one. Default
	// tasks.DefaultMaxAttempts.
	MaxAttempts int
	Clock       clock.Clock
	Logger      hclog.Logger
	// Registry receives the coordinator's metrics; default a new one.
	Registry *prometheus.Registry
	// TracerProvider, when set, traces POST /api/tasks: a server span that
	// joins the caller's traceparent, and the client's enqueue span under
	// it, whose trace the task's runner spans join (docs/reference.md, Traces). Nil:
	// tracing off. cmd/coordinator sets it from the OTEL_* environment.
	TracerProvider trace.TracerProvider
}

// WithDefaults returns c with its zero settings (and its leader's)
// replaced by the defaults, as New does.
func (c Config) WithDefaults() Config {
	l := c.leadership().WithDefaults()
	c.ElectionTTL, c.MaxAttempts, c.Sweep, c.Retention, c.Unhandled = l.ElectionTTL, l.MaxAttempts, l.Sweep, l.Retention, l.Unhandled
	c.HTTPAddr = cmp.Or(c.HTTPAddr, DefaultHTTPAddr)
	return c
}

// leadership is the settings of the coordinator's leader.
func (c Config) leadership() leadership.Config {
	return leadership.Config{ID: c.ID, Prefix: c.Prefix, ShardCount: c.ShardCount, MaxAttempts: c.MaxAttempts,
		ElectionTTL: c.ElectionTTL, Sweep: c.Sweep, Retention: c.Retention, Unhandled: c.Unhandled,
		Clock: c.Clock, Logger: c.Logger}
}

// Validate reports the first bad setting in one line naming its flag,
// before anything connects. It checks the settings as they are: a zero
// where New would put a default is an error, so that a flag given as 0 is
// refused rather than replaced (use WithDefaults for library defaults).
// Client and Store are New's business.
func (c Config) Validate() error {
	if err := c.httpServer().Check(); err != nil {
		return err
	}
	return c.leadership().Validate()
}

func (c Config) httpServer() cli.Server {
	return cli.Server{AddrFlag: "--http-addr", Addr: c.HTTPAddr, TokenFlag: "--api-token", TokenVar: "SHARDRUN_API_TOKEN",
		Token: c.APIToken, TLS: cli.TLS{Flag: "--http", Cert: c.HTTPCert, Key: c.HTTPKey}}
}
