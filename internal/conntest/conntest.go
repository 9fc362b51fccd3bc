// Package conntest serves test connections on a listener and closes them
// when the test ends. It imports nothing of ngstone's, so every package's
// tests can use it (tunneltest imports edge and agent; wan's tests cannot).
package conntest

import (
	"net"
	"sync"
	"testing"
)

// Serve accepts on ln until the test ends, serving each connection with
// serve in a goroutine of its own and closing it after. At the end it
// closes ln and every connection still open, then waits for the serves.
func Serve(t testing.TB, ln net.Listener, serve func(net.Conn)) {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
	)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = struct{}{}
			mu.Unlock()
			wg.Go(func() {
				defer func() {
					c.Close()
					mu.Lock()
					delete(conns, c)
					mu.Unlock()
				}()
				serve(c)
			})
		}
	})
}

// DeadAddr returns a loopback address nothing listens on (one just freed).
func DeadAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
