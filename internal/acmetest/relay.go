package acmetest

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Relay is a loopback TCP port that forwards each connection to a target
// set later. Pebble's VA must know the ports it validates HTTP-01 and
// TLS-ALPN-01 on when it is made, but an edge binds its listeners only
// after its certificates have started, which needs pebble first: give the
// VA a relay's Port, and point the relay at the listener once it exists.
type Relay struct {
	ln net.Listener

	mu     sync.Mutex
	target string
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// StartRelay listens on a free loopback port until the end of the test.
// Connections that arrive before SetTarget are closed at once.
func StartRelay(t testing.TB) *Relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Relay{ln: ln, conns: map[net.Conn]struct{}{}}
	r.wg.Add(1)
	go r.accept()
	t.Cleanup(r.close)
	return r
}

// Port is the relay's loopback port.
func (r *Relay) Port() int { return r.ln.Addr().(*net.TCPAddr).Port }

// SetTarget makes new connections go to addr (HOST:PORT).
func (r *Relay) SetTarget(addr string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.target = addr
}

func (r *Relay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		target := r.target
		r.mu.Unlock()
		if target == "" || !r.track(c) {
			c.Close()
			continue
		}
		r.wg.Add(1)
		go r.forward(c, target)
	}
}

// track registers c to be cut by close; false if the relay is closed.
func (r *Relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *Relay) untrack(c net.Conn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.conns, c)
}

// forward copies c to target and back until both sides are done.
func (r *Relay) forward(c net.Conn, target string) {
	defer r.wg.Done()
	defer r.untrack(c)
	defer c.Close()
	up, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	if !r.track(up) {
		return
	}
	defer r.untrack(up)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(up, c)
		_ = up.(*net.TCPConn).CloseWrite()
	}()
	_, _ = io.Copy(c, up)
	_ = c.(*net.TCPConn).CloseWrite()
	<-done
}

// close stops accepting, cuts every relayed connection and waits for the
// relay's goroutines.
func (r *Relay) close() {
	r.ln.Close()
	r.mu.Lock()
	r.closed = true
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}
