package agent

import (
	"context"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ngstone/ngstone/internal/wan"
	"github.com/ngstone/ngstone/internal/wan/wantest"
)

// TestDialAfterBlackhole dials over a real link (two network namespaces,
// internal/wan) that drops every packet, then comes back: until then the
// agent sends one SYN per pace.every (and the first attempt's own resends),
// and the connection it takes is a fresh attempt's, whose SYN was never
// sent again, so it starts with the full initial congestion window. Needs
// root; it costs about 2 s.
func TestDialAfterBlackhole(t *testing.T) {
	p := wantest.Start(t)
	p.Set(wan.Symmetric("20ms", 20*time.Millisecond, 0, 0))
	ln, err := p.A.Listen("tcp", netip.AddrPortFrom(p.AddrA(), 0).String())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer ln.Close()
	wg.Go(func() {
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	})

	pc := paceFor(20 * time.Millisecond)
	p.Blackhole(true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	type result struct {
		c   net.Conn
		err error
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		c, err := staggered(ctx, pc, func(ctx context.Context) (net.Conn, error) {
			return p.B.DialContext(ctx, "tcp", ln.Addr().String())
		})
		done <- result{c, err}
	}()
	// About 1.5 s in (the first SYN, its resend at 1 s, a fresh one each
	// pace.every): past the life of the fresh attempts started with the
	// first, and half a second short of its next resend, which a fresh SYN
	// must beat.
	syns := uint64(1500*time.Millisecond/pc.every) + 2
	deadline := time.Now().Add(10 * time.Second)
	for dropped(p) < syns {
		if time.Now().After(deadline) {
			t.Fatalf("%d SYNs dropped in 10s, want %d", dropped(p), syns)
		}
		time.Sleep(time.Millisecond) // polls the link's counter
	}
	elapsed := time.Since(start)
	n := dropped(p)
	p.Blackhole(false)
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.c.Close()
	// One fresh SYN per pace, and the first dial's: at most one a second.
	if most := uint64(elapsed/pc.every) + 1 + uint64(elapsed/time.Second) + 1; n > most {
		t.Errorf("%d SYNs in %v of black-hole, want at most %d (one per %v)", n, elapsed, most, pc.every)
	}
	info := tcpInfo(t, r.c)
	if info.Total_retrans != 0 || info.Snd_cwnd < 10 {
		t.Errorf("the connection taken resent its SYN %d times and starts with %d segments, want a fresh one's 0 and 10", info.Total_retrans, info.Snd_cwnd)
	}
}

// dropped is the packets side B sent into the black hole.
func dropped(p *wan.Pair) uint64 {
	_, ba := p.Stats()
	return ba.Blackholed
}

func tcpInfo(t *testing.T, c net.Conn) *unix.TCPInfo {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	var serr error
	if err := rc.Control(func(fd uintptr) { info, serr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatal(serr)
	}
	return info
}
