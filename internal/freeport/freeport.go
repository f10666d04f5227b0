// Package freeport finds loopback ports nothing listens on, for servers a
// process starts for itself (a throwaway PostgreSQL, an embedded etcd, the
// demo's runners).
package freeport

import (
	"fmt"
	"net"
)

// Port returns a loopback TCP port that was free a moment ago. Another
// process may take it before the caller binds it; the callers start servers
// that fail loudly if so.
func Port() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
