// Package faultproxy is an in-process TCP proxy for fault injection: tests
// put it between a runner and etcd and make the link pass, blackhole (bytes
// are held, connections stay open, like a partition that heals) or reset
// (every connection is cut and new ones are refused).
package faultproxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// Mode is what the proxy does with traffic.
type Mode int

// The modes.
const (
	Pass Mode = iota
	Blackhole
	Reset
)

// Proxy forwards connections from its address to a target.
type Proxy struct {
	target string
	ln     net.Listener

	mu      sync.Mutex
	mode    Mode
	changed chan struct{} // closed and replaced on every mode change
	conns   map[net.Conn]struct{}
	wg      sync.WaitGroup
	closed  bool
}

// New listens on a free loopback port and forwards to target (host:port).
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{target: target, ln: ln, changed: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Pass forwards traffic again; held bytes flow on.
func (p *Proxy) Pass() { p.setMode(Pass) }

// Blackhole holds all bytes in both directions without closing anything.
func (p *Proxy) Blackhole() { p.setMode(Blackhole) }

// Reset cuts every connection and refuses new ones until Pass.
func (p *Proxy) Reset() {
	p.setMode(Reset)
	p.mu.Lock()
	for c := range p.conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		_ = c.Close()
	}
	p.mu.Unlock()
}

func (p *Proxy) setMode(m Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = m
	close(p.changed)
	p.changed = make(chan struct{})
}

// Close stops the proxy and every connection through it.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	_ = p.ln.Close()
	for c := range p.conns {
		_ = c.Close()
	}
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.closed || p.mode == Reset {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(c)
	}
}

func (p *Proxy) track(c net.Conn, add bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		if p.closed {
			return false
		}
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
	return true
}

func (p *Proxy) serve(down net.Conn) {
	defer p.wg.Done()
	up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = down.Close()
		return
	}
	if !p.track(down, true) || !p.track(up, true) {
		_ = down.Close()
		_ = up.Close()
		return
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pump(up, down) }()
	go func() { defer wg.Done(); p.pump(down, up) }()
	wg.Wait()
	p.track(down, false)
	p.track(up, false)
}

// pump copies src to dst, holding each chunk while the proxy blackholes.
func (p *Proxy) pump(dst, src net.Conn) {
	defer func() { _ = dst.Close(); _ = src.Close() }()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.waitToForward() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				return
			}
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

// waitToForward blocks while blackholed; false means stop (reset or closed).
func (p *Proxy) waitToForward() bool {
	for {
		p.mu.Lock()
		mode, changed, closed := p.mode, p.changed, p.closed
		p.mu.Unlock()
		switch {
		case closed || mode == Reset:
			return false
		case mode == Pass:
			return true
		}
		<-changed
	}
}
