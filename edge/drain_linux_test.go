package edge

import (
	"io"
	"net"
	"testing"
	"time"
)

// TestRefuseHandshakes: once a visitor listener refuses handshakes, a new
// visitor does not get connected (its SYN is dropped), while a connection
// that completed before is still accepted and carries its bytes, and
// acceptQueued takes what the queue holds. The listener is the edge's
// own: Go's default one is multipath TCP where the kernel has it, which
// refuses the filter.
func TestRefuseHandshakes(t *testing.T) {
	ln, err := listenVisitors("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	before, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer before.Close()
	queued, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer queued.Close()
	if !refuseHandshakes(ln) {
		t.Fatal("the visitor listener refused the socket filter")
	}
	if c, err := net.DialTimeout("tcp", addr, 500*time.Millisecond); err == nil {
		c.Close()
		t.Fatal("a new visitor was connected after the listener refused handshakes")
	} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("a new visitor's dial: %v, want a timeout (its SYN dropped, not refused)", err)
	}
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(before, "GET / HTTP/1.1\r\n"); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 16)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("the connection made before the filter: %v", err)
	}
	left := acceptQueued(ln, maxDrained)
	for _, c := range left {
		defer c.Close()
	}
	if len(left) != 1 {
		t.Fatalf("acceptQueued took %d connections, want the 1 queued", len(left))
	}
}
