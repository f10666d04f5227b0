package cli

import (
	"strings"
	"testing"

	"github.com/shardrun/shardrun/internal/certgen"
)

func TestTLSFlags(t *testing.T) {
	ca, err := certgen.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	pair, err := ca.Issue("x", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	ok := TLS{Flag: "--etcd", CA: string(ca.PEM), Cert: string(pair.Cert), Key: string(pair.Key)}
	if c, err := ok.Client(); err != nil || c.RootCAs == nil || len(c.Certificates) != 1 {
		t.Fatalf("client config: %v", err)
	}
	if c, err := ok.Server(); err != nil || c.ClientCAs == nil {
		t.Fatalf("a server with a CA requires client certificates: %v", err)
	}
	for _, tc := range []struct {
		tls  TLS
		want string
	}{
		{TLS{Flag: "--etcd", Cert: string(pair.Cert)}, "--etcd-cert and --etcd-key: give both"},
		{TLS{Flag: "--etcd", CA: "not pem"}, "--etcd-ca: no PEM"},
		{TLS{Flag: "--etcd", Cert: string(pair.Cert), Key: string(ca.PEM)}, "--etcd-cert and --etcd-key: not a PEM"},
	} {
		if _, err := tc.tls.Client(); err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "PRIVATE") {
			t.Errorf("%+v: %v, want %q", tc.tls.Flag, err, tc.want)
		}
	}
	if _, err := (TLS{Flag: "--http", CA: string(ca.PEM)}).Server(); err == nil {
		t.Error("a server without a certificate was configured")
	}
	if err := CheckEtcdTLS([]string{"http://127.0.0.1:2379"}, ok); err == nil || !strings.Contains(err.Error(), "not https://") {
		t.Errorf("plain endpoints with etcd TLS: %v", err)
	}
	if err := CheckEtcdTLS([]string{"https://127.0.0.1:2379"}, ok); err != nil {
		t.Error(err)
	}
}

// A token on a plain HTTP server off loopback draws a warning naming the
// flags; on loopback or with TLS it does not.
func TestPlainTokenWarning(t *testing.T) {
	srv := func(addr, token string, tls bool) Server {
		s := Server{AddrFlag: "--admin-addr", Addr: addr, TokenFlag: "--admin-token", TokenVar: "SHARDRUN_ADMIN_TOKEN", Token: token, TLS: TLS{Flag: "--admin"}}
		if tls {
			s.TLS.Cert = "x"
		}
		return s
	}
	if w := srv("0.0.0.0:9090", "t", false).Warning(); !strings.Contains(w, "--admin-cert") || !strings.Contains(w, "clear text") {
		t.Errorf("warning: %q", w)
	}
	for _, s := range []Server{srv("127.0.0.1:9090", "t", false), srv("0.0.0.0:9090", "t", true), srv("0.0.0.0:9090", "", false), srv("[::1]:9090", "t", false)} {
		if w := s.Warning(); w != "" {
			t.Errorf("%+v: %q", s, w)
		}
	}
	if err := srv("0.0.0.0:9090", "", false).Check(); err == nil || !strings.Contains(err.Error(), "--admin-token (SHARDRUN_ADMIN_TOKEN or SHARDRUN_ADMIN_TOKEN_FILE): required") {
		t.Errorf("no token off loopback: %v", err)
	}
}
