package embedetcd

import (
	"context"
	"net"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/pkg/v3/schedule.(*fifo).run"))
}

// The retry on a port taken between probing and binding depends on
// recognising etcd's own bind error.
func TestTakenClientAddressIsReportedAsInUse(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, err = Start(context.Background(), Config{Dir: t.TempDir(), ClientAddr: l.Addr().String(), Fast: true})
	if err == nil {
		t.Fatal("started on an address something else listens on")
	}
	if !isAddrInUse(err) {
		t.Fatalf("bind error not recognised, so ports would not be retried: %v", err)
	}
	if !strings.Contains(err.Error(), l.Addr().String()) {
		t.Errorf("error does not name the address: %v", err)
	}
}

func TestStartsOnFreePorts(t *testing.T) {
	srv, err := Start(context.Background(), Config{Dir: t.TempDir(), Fast: true})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	c, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatalf("not serving on %s: %v", srv.Addr(), err)
	}
	c.Close()
}
