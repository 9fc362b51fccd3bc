package wan

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/conntest"
)

// startPair starts a Pair, or skips where one cannot run (not root, no
// TUN device, no ip(8)).
func startPair(t *testing.T) *Pair {
	t.Helper()
	if err := Usable(); err != nil {
		t.Skip(err)
	}
	p := &Pair{}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}

// echo serves TCP echo on side B of p and returns its address as A sees
// it; the test's end closes it and waits for its connections.
func echo(t *testing.T, p *Pair) string {
	t.Helper()
	ln, err := p.B.Listen("tcp", netip.AddrPortFrom(p.AddrB(), 0).String())
	if err != nil {
		t.Fatal(err)
	}
	conntest.Serve(t, ln, func(c net.Conn) { io.Copy(c, c) })
	return ln.Addr().String()
}

func dialA(t *testing.T, p *Pair, addr string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c, err := p.A.DialContext(ctx, "tcp", addr)
	if err == nil {
		t.Cleanup(func() { c.Close() })
	}
	return c, err
}

// TestPairRoundTrip: an echo across the link takes at least its round
// trip, and the sides reach each other only through it.
func TestPairRoundTrip(t *testing.T) {
	p := startPair(t)
	const rtt = 60 * time.Millisecond
	p.Set(Symmetric("test", rtt, 0, 0))
	c, err := dialA(t, p, echo(t, p), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 100)
	for range 3 {
		start := time.Now()
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d < rtt {
			t.Fatalf("echo in %v, under the %v round trip", d, rtt)
		}
	}
	if atob, btoa := p.Stats(); atob.Delivered == 0 || btoa.Delivered == 0 {
		t.Fatalf("no packets through the forwarder: %+v %+v", atob, btoa)
	}
}

// TestPairRate: a transfer across a rate-limited link takes at least what
// the rate allows, less the queue it may fill first.
func TestPairRate(t *testing.T) {
	p := startPair(t)
	const rate, n = 1 << 20, 2 << 20 // bytes per second, bytes
	p.Set(Profile{AtoB: Link{Rate: rate, Queue: 64 << 10, Delay: 5 * time.Millisecond}, BtoA: Link{Delay: 5 * time.Millisecond}})
	c, err := dialA(t, p, echo(t, p), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(60 * time.Second))
	start := time.Now()
	go c.Write(make([]byte, n))
	if _, err := io.ReadFull(c, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	if d, least := time.Since(start), time.Duration(float64(n-64<<10)/rate*float64(time.Second)); d < least {
		t.Fatalf("%d bytes in %v at %d B/s; at least %v expected", n, d, rate, least)
	}
	if atob, _ := p.Stats(); atob.Bytes < n {
		t.Fatalf("%d bytes through the limited direction, want at least %d", atob.Bytes, n)
	}
}

// TestPairLossAndBlackhole: with loss every packet is dropped or
// delivered, about the share expected each way; a black hole stops a
// connection attempt until it is lifted.
func TestPairLossAndBlackhole(t *testing.T) {
	p := startPair(t)
	addr := echo(t, p)
	p.Set(Symmetric("lossy", 10*time.Millisecond, 0.05, 0))
	c, err := dialA(t, p, addr, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(60 * time.Second))
	const n = 4 << 20
	go c.Write(make([]byte, n))
	if _, err := io.ReadFull(c, make([]byte, n)); err != nil {
		t.Fatal(err)
	}
	for _, st := range []Stats{first(p.Stats()), second(p.Stats())} {
		// TCP resends what is lost: about 5% of what arrives is dropped.
		if all := st.Delivered + st.Lost; st.Lost == 0 || float64(st.Lost) > 0.15*float64(all) {
			t.Fatalf("lost %d of %d packets at 5%%", st.Lost, all)
		}
	}

	p.Set(Symmetric("clear", 10*time.Millisecond, 0, 0))
	p.Blackhole(true)
	var timeout net.Error
	if _, err := dialA(t, p, addr, 500*time.Millisecond); !errors.As(err, &timeout) || !timeout.Timeout() {
		t.Fatalf("dial through a black hole: %v, want a timeout", err)
	}
	p.Blackhole(false)
	if _, err := dialA(t, p, addr, 30*time.Second); err != nil {
		t.Fatalf("dial after the black hole: %v", err)
	}
}

func first(a, _ Stats) Stats  { return a }
func second(_, b Stats) Stats { return b }
