// Package embedetcd runs a single-node etcd inside the process: the
// coordinator's --embed-etcd mode and the tests use it, so that a one-machine
// deployment and every test get a real etcd without a separate binary.
package embedetcd

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/shardrun/shardrun/internal/freeport"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Config configures the embedded server.
type Config struct {
	// Dir is the data directory; required.
	Dir string
	// ClientAddr is host:port for clients; default 127.0.0.1 on a free port.
	ClientAddr string
	// Fast uses 10ms heartbeats and a 100ms election timeout: a test server
	// starts in tens of milliseconds instead of about a second. The minimum
	// lease TTL is about 1.5 election timeouts, so TTLs of 1s and up work.
	Fast bool
	// MaxTxnOps overrides etcd's default of 128 operations per transaction.
	MaxTxnOps uint
	// CertFile and KeyFile, when set, make the client port serve TLS with
	// this certificate; ClientCAFile, when set too, requires clients to
	// present a certificate it signed (mutual TLS).
	CertFile, KeyFile, ClientCAFile string
	// Logger receives etcd's warnings and errors; nil discards them (etcd
	// logs every request slower than 100ms at info level otherwise).
	Logger hclog.Logger
}

// Server is a running embedded etcd.
type Server struct {
	e         *embed.Etcd
	endpoints []string
	level     zap.AtomicLevel
}

// Start starts the server and returns once it serves clients.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Dir == "" {
		return nil, fmt.Errorf("embedded etcd: a data directory is required")
	}
	ec := embed.NewConfig()
	ec.Name = "shardrun"
	ec.Dir = cfg.Dir
	ec.LogLevel = "warn"
	level := zap.NewAtomicLevelAt(zap.WarnLevel)
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zapLogger(cfg.Logger, level))
	if cfg.Fast {
		ec.TickMs, ec.ElectionMs = 10, 100
	}
	if cfg.MaxTxnOps > 0 {
		ec.MaxTxnOps = cfg.MaxTxnOps
	}
	if cfg.CertFile != "" {
		ec.ClientTLSInfo.CertFile, ec.ClientTLSInfo.KeyFile = cfg.CertFile, cfg.KeyFile
		ec.ClientTLSInfo.TrustedCAFile, ec.ClientTLSInfo.ClientCertAuth = cfg.ClientCAFile, cfg.ClientCAFile != ""
	}
	// The ports are probed free and bound a moment later; another process
	// (a parallel test package) may take one in between. Binding happens
	// before etcd writes its data directory, so trying new ports is safe.
	var e *embed.Etcd
	var cu url.URL
	for attempt := 0; ; attempt++ {
		var err error
		if cu, err = listenURLs(ec, cfg.ClientAddr, cfg.CertFile != ""); err != nil {
			return nil, err
		}
		e, err = embed.StartEtcd(ec)
		if err == nil {
			break
		}
		if attempt >= 3 || !isAddrInUse(err) {
			return nil, fmt.Errorf("starting embedded etcd in %s on %s: %w", cfg.Dir, cu.Host, err)
		}
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("embedded etcd failed to start: %w", err)
	case <-ctx.Done():
		e.Close()
		return nil, fmt.Errorf("embedded etcd did not become ready: %w", ctx.Err())
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, fmt.Errorf("embedded etcd did not become ready within 60s")
	}
	return &Server{e: e, endpoints: []string{cu.String()}, level: level}, nil
}

// listenURLs sets the client and peer URLs: clientAddr, or a free loopback
// port when empty, and always a free loopback peer port.
func listenURLs(ec *embed.Config, clientAddr string, tls bool) (url.URL, error) {
	if clientAddr == "" {
		port, err := freeport.Port()
		if err != nil {
			return url.URL{}, fmt.Errorf("embedded etcd: %w", err)
		}
		clientAddr = fmt.Sprintf("127.0.0.1:%d", port)
	}
	peerPort, err := freeport.Port()
	if err != nil {
		return url.URL{}, fmt.Errorf("embedded etcd: %w", err)
	}
	scheme := "http"
	if tls {
		scheme = "https"
	}
	cu, err := url.Parse(scheme + "://" + clientAddr)
	if err != nil {
		return url.URL{}, fmt.Errorf("embedded etcd: client address %q: %w", clientAddr, err)
	}
	pu := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	return *cu, nil
}

// isAddrInUse reports a failed bind. etcd does not always wrap the
// syscall error, so its text is checked too.
func isAddrInUse(err error) bool {
	return errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use")
}

// Endpoints are the client URLs.
func (s *Server) Endpoints() []string { return s.endpoints }

// Addr is the client host:port.
func (s *Server) Addr() string {
	return strings.TrimPrefix(strings.TrimPrefix(s.endpoints[0], "http://"), "https://")
}

// Close stops the server. etcd reports its own orderly shutdown (closed
// listeners) as errors, so nothing short of fatal is logged from here on.
func (s *Server) Close() {
	s.level.SetLevel(zap.FatalLevel)
	s.e.Close()
}

// zapLogger routes etcd's warnings and errors into hclog.
func zapLogger(log hclog.Logger, level zap.AtomicLevel) *zap.Logger {
	if log == nil {
		return zap.NewNop()
	}
	enc := zapcore.NewConsoleEncoder(zapcore.EncoderConfig{MessageKey: "msg", LevelKey: "", TimeKey: ""})
	w := log.StandardWriter(&hclog.StandardLoggerOptions{ForceLevel: hclog.Warn})
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(w), level))
}

// MessagesReceived is the number of gRPC messages (unary requests and stream
// messages) every embedded server in this process has received, from etcd's
// own server metrics. Benchmarks divide its growth by time and runners to
// get the etcd load one runner causes.
func MessagesReceived() (float64, error) {
	families, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		return 0, fmt.Errorf("gathering etcd server metrics: %w", err)
	}
	var total float64
	for _, f := range families {
		if f.GetName() != "grpc_server_msg_received_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			total += m.GetCounter().GetValue()
		}
	}
	return total, nil
}
