package main

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ngstone/ngstone/certs"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRelayChain: two relays in a row, as the floor runs them, carry bytes
// both ways, pass a half-close on, and stop when their context ends.
func TestRelayChain(t *testing.T) {
	echo := echoServer(t)
	ctx, cancel := context.WithCancel(context.Background())
	to := echo.addr
	done := make(chan error, 2)
	for range 2 {
		ln := listen(t)
		go func(to string) { done <- relay(ctx, ln, to) }(to)
		to = ln.Addr().String()
	}
	roundTrip(t, to, 1<<20)
	echo.check(t)
	cancel()
	waitCanceled(t, done, 2)
}

// TestMuxFloor: the mux floor's two sides, over real TLS and yamux, carry
// bytes both ways, pass a half-close on through the stream, and stop when
// their context ends.
func TestMuxFloor(t *testing.T) {
	echo := echoServer(t)
	visitors, cancel, done := startFloor(t, muxEdge, muxAgent, echo.addr)
	defer cancel()

	// A visitor that comes before the agent's session is closed at once;
	// one byte echoed says the session is there.
	deadline := time.Now().Add(10 * time.Second)
	for !echoesOne(visitors) {
		if time.Now().After(deadline) {
			t.Fatal("the mux floor did not echo a byte within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	echo.wait(t) // the probe's own connection to the echo server
	roundTrip(t, visitors, 1<<20)
	echo.check(t)
	cancel()
	waitCanceled(t, done, 2)
}

// startFloor runs a floor's edge and agent sides over real TLS and yamux
// on loopback, the agent's next hop to. It returns the visitors' address,
// what ends both, and where each side's return is sent.
func startFloor(t *testing.T, edge func(context.Context, net.Listener, net.Listener) error, agent func(context.Context, net.Conn, string) error, to string) (visitors string, cancel context.CancelFunc, done chan error) {
	t.Helper()
	m, err := certs.New(certs.Config{Mode: certs.ModeSelfSigned, Domain: muxDomain, DataDir: t.TempDir()}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := m.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	vl, tl := listen(t), listen(t)
	done = make(chan error, 2)
	go func() { done <- edge(ctx, vl, tls.NewListener(tl, m.TLSConfig())) }()
	raw, err := net.Dial("tcp", tl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c := tls.Client(raw, &tls.Config{ServerName: muxDomain, InsecureSkipVerify: true})
	go func() { done <- agent(ctx, c, to) }()
	return vl.Addr().String(), cancel, done
}

func echoesOne(addr string) bool {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return false
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	b := []byte{'x'}
	if _, err := c.Write(b); err != nil {
		return false
	}
	c.(*net.TCPConn).CloseWrite()
	_, err = io.ReadFull(c, b)
	return err == nil && b[0] == 'x'
}

// echo is a server that echoes each connection until its half-close and
// reports how each ended.
type echo struct {
	addr  string
	ended chan error
}

func echoServer(t *testing.T) *echo {
	ln := listen(t)
	e := &echo{addr: ln.Addr().String(), ended: make(chan error, 16)}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, err := io.Copy(c, c) // until the client's half-close arrives
				e.ended <- err
			}()
		}
	}()
	return e
}

// wait waits for one connection to end, whatever its error.
func (e *echo) wait(t *testing.T) {
	t.Helper()
	select {
	case <-e.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("an echo connection did not end within 10s")
	}
}

// check waits for one connection to end and fails the test on its error.
func (e *echo) check(t *testing.T) {
	t.Helper()
	select {
	case err := <-e.ended:
		if err != nil {
			t.Fatalf("echo: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the echo connection did not end within 10s")
	}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// roundTrip sends n bytes to addr, half-closes, and checks that the same
// bytes come back before the end.
func roundTrip(t *testing.T, addr string, n int) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := make([]byte, n)
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	go func() {
		c.Write(msg)
		c.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != string(msg) {
		t.Fatalf("read %d of %d bytes back (%v), or not the same ones", len(got), len(msg), err)
	}
}

func waitCanceled(t *testing.T, done chan error, n int) {
	t.Helper()
	for range n {
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("returned %v, want context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a relay did not stop within 10s of its context's end")
		}
	}
}
