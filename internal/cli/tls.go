package cli

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
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

// Client is the configuration of a client that verifies the server with
// CA (the system's roots without one) and presents the certificate, if
// given (mutual TLS); nil when nothing is given.
func (t TLS) Client() (*tls.Config, error) {
	if !t.Set() {
		return nil, nil
	}
	certs, err := t.pair()
	if err != nil {
		return nil, err
	}
	pool, err := t.pool()
	if err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: pool, Certificates: certs}, nil
}

// Server is the configuration of a server that presents the certificate
// (required) and, with a CA, requires clients to present one it signed;
// nil when nothing is given.
func (t TLS) Server() (*tls.Config, error) {
	if !t.Set() {
		return nil, nil
	}
	certs, err := t.pair()
	if err != nil {
		return nil, err
	}
	if certs == nil {
		return nil, fmt.Errorf("%s-cert and %s-key: required to serve TLS", t.Flag, t.Flag)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: certs}
	if pool, err := t.pool(); err != nil {
		return nil, err
	} else if pool != nil {
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

// PlainTokenWarning says why a bearer token on a server without TLS
// (tlsOn false) listening off loopback is readable off the network, or ""
// when it is not. The token is not refused: TLS is often ended in front of
// the server (a proxy, an ingress) or the network is private (the compose
// deployment); the warning names the flags that give the server TLS.
func PlainTokenWarning(addrFlag, addr, tokenFlag, token, certFlag string, tlsOn bool) string {
	host, _, _ := net.SplitHostPort(addr)
	if token == "" || tlsOn || IsLoopback(host) {
		return ""
	}
	return fmt.Sprintf("%s travels in clear text: %s (%s) is not loopback and the server has no TLS; give %s and its key, or end TLS in front of it", tokenFlag, addrFlag, addr, certFlag)
}

// EtcdTLSFlags declares the etcd client's TLS flags, the same for every
// binary: --etcd-ca, --etcd-cert and --etcd-key, each also from a file.
func (f *FlagSet) EtcdTLSFlags(ca, cert, key *string) {
	f.PEM(ca, "etcd-ca", "SHARDRUN_ETCD_CA", "PEM of the CA that signed the etcd servers' certificates (default: the system's roots); the endpoints must then be https://")
	f.PEM(cert, "etcd-cert", "SHARDRUN_ETCD_CERT", "PEM client certificate for etcd's mutual TLS (with --etcd-key)")
	f.Secret(key, "etcd-key", "SHARDRUN_ETCD_KEY", "PEM private key of --etcd-cert")
}
