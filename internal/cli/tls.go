package cli

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"github.com/shardrun/shardrun/internal/httpauth"
	"net"
	"net/url"
)

// TLS is the PEM material of one TLS connection's side, as the flags give
// it: a CA to verify the other side with, and a certificate and key to
// present. Flag is the flags' common prefix (--etcd: --etcd-ca,
// --etcd-cert, --etcd-key), for messages.
type TLS struct {
	Flag          string
	CA, Cert, Key string
}

// Set reports whether any of it is given.
func (t TLS) Set() bool { return t.CA != "" || t.Cert != "" || t.Key != "" }

// pair parses the certificate and key, which come together or not at all.
func (t TLS) pair() ([]tls.Certificate, error) {
	switch {
	case t.Cert == "" && t.Key == "":
		return nil, nil
	case t.Cert == "" || t.Key == "":
		return nil, fmt.Errorf("%s-cert and %s-key: give both or neither", t.Flag, t.Flag)
	}
	pair, err := tls.X509KeyPair([]byte(t.Cert), []byte(t.Key))
	if err != nil {
		// The message names no key material.
		return nil, fmt.Errorf("%s-cert and %s-key: not a PEM certificate and its private key: %v", t.Flag, t.Flag, err)
	}
	return []tls.Certificate{pair}, nil
}

func (t TLS) pool() (*x509.CertPool, error) {
	if t.CA == "" {
		return nil, nil // the system's roots
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM([]byte(t.CA)) {
		return nil, fmt.Errorf("%s-ca: no PEM certificate in it", t.Flag)
	}
	return pool, nil
}

// parse returns the certificate (if given) and the CA pool (nil: the
// system's roots); set is false when nothing is given.
func (t TLS) parse() (certs []tls.Certificate, pool *x509.CertPool, set bool, err error) {
	if !t.Set() {
		return nil, nil, false, nil
	}
	if certs, err = t.pair(); err != nil {
		return nil, nil, true, err
	}
	pool, err = t.pool()
	return certs, pool, true, err
}

// Client is the configuration of a client that verifies the server with
// CA (the system's roots without one) and presents the certificate, if
// given (mutual TLS); nil when nothing is given.
func (t TLS) Client() (*tls.Config, error) {
	certs, pool, set, err := t.parse()
	if !set || err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool, Certificates: certs}, nil
}

// Server is the configuration of a server that presents the certificate
// (required) and, with a CA, requires clients to present one it signed;
// nil when nothing is given.
func (t TLS) Server() (*tls.Config, error) {
	certs, pool, set, err := t.parse()
	switch {
	case !set || err != nil:
		return nil, err
	case certs == nil:
		return nil, fmt.Errorf("%s-cert and %s-key: required to serve TLS", t.Flag, t.Flag)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: certs}
	if pool != nil {
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// CheckEtcdTLS checks that endpoints fit the etcd client TLS t: with TLS
// material every endpoint is https, so that no connection falls back to
// plain text.
func CheckEtcdTLS(endpoints []string, t TLS) error {
	if _, err := t.Client(); err != nil {
		return err
	}
	if !t.Set() {
		return nil
	}
	for _, e := range endpoints {
		if u, err := url.Parse(e); err == nil && u.Scheme != "https" {
			return fmt.Errorf("--etcd-endpoints: %s is not https:// although %s-ca, %s-cert or %s-key is given", quoteEndpoint(e), t.Flag, t.Flag, t.Flag)
		}
	}
	return nil
}

// Server is what the flags say about one of the binaries' HTTP servers
// (the runner's admin endpoint, the coordinator's API): where it listens,
// its bearer token and its TLS. Flags name them in messages: AddrFlag
// --admin-addr, TokenFlag --admin-token, TokenVar SHARDRUN_ADMIN_TOKEN,
// TLS.Flag --admin.
type Server struct {
	AddrFlag, Addr             string
	TokenFlag, TokenVar, Token string
	TLS                        TLS
}

// Check validates the address, the token (required off loopback, where
// anyone on the network could call the server) and the TLS pair.
func (s Server) Check() error {
	host, err := CheckListenAddr(s.AddrFlag, s.Addr)
	if err != nil {
		return err
	}
	if s.Token == "" && !IsLoopback(host) {
		return fmt.Errorf("%s (%s or %s_FILE): required when %s (%s) is not a loopback address", s.TokenFlag, s.TokenVar, s.TokenVar, s.AddrFlag, s.Addr)
	}
	if s.Token != "" {
		if err := httpauth.CheckToken(s.Token); err != nil {
			return fmt.Errorf("%s: %w", s.TokenFlag, err)
		}
	}
	_, err = s.TLS.Server()
	return err
}

// Listen listens on the server's address, with TLS when it has a
// certificate.
func (s Server) Listen() (net.Listener, error) {
	tlsConfig, err := s.TLS.Server()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", s.Addr)
	if err != nil {
		return nil, fmt.Errorf("%s: listening on %s: %w", s.AddrFlag, s.Addr, err)
	}
	if tlsConfig != nil {
		ln = tls.NewListener(ln, tlsConfig)
	}
	return ln, nil
}

// Warning says why the bearer token of a server without TLS listening off
// loopback is readable off the network, or "" when it is not. The token
// is not refused: TLS is often ended in front of the server (a proxy, an
// ingress) or the network is private (the compose deployment); the
// warning names the flag that gives the server TLS.
func (s Server) Warning() string {
	host, _, _ := net.SplitHostPort(s.Addr)
	if s.Token == "" || s.TLS.Set() || IsLoopback(host) {
		return ""
	}
	return fmt.Sprintf("%s travels in clear text: %s (%s) is not loopback and the server has no TLS; give %s-cert and %s-key, or end TLS in front of it",
		s.TokenFlag, s.AddrFlag, s.Addr, s.TLS.Flag, s.TLS.Flag)
}

// EtcdTLSFlags declares the etcd client's TLS flags, the same for every
// binary: --etcd-ca, --etcd-cert and --etcd-key, each also from a file.
func (f *FlagSet) EtcdTLSFlags(ca, cert, key *string) {
	f.PEM(ca, "etcd-ca", "SHARDRUN_ETCD_CA", "PEM of the CA that signed the etcd servers' certificates (default: the system's roots); the endpoints must then be https://")
	f.PEM(cert, "etcd-cert", "SHARDRUN_ETCD_CERT", "PEM client certificate for etcd's mutual TLS (with --etcd-key)")
	f.Secret(key, "etcd-key", "SHARDRUN_ETCD_KEY", "PEM private key of --etcd-cert")
}
