package edge_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestPerAddressBoundsCountIPv6ByPrefix: visitors of one IPv6 /64 share
// --max-conns-per-ip and --max-requests-per-ip, as they share the auth
// limiter's count: counted by the address, a host holding a /64 has 2^64
// of each. The visitors' addresses come in PROXY headers from a trusted
// load balancer on loopback (127.0.0.4). Another /64 is not held back.
func TestPerAddressBoundsCountIPv6ByPrefix(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.ProxyProtocol = true
	cfg.ProxyProtocolFrom = []netip.Prefix{netip.MustParsePrefix("127.0.0.4/32")}
	cfg.MaxConnsPerIP = 2
	cfg.MaxRequestsPerIP = 1
	cfg.ReadHeaderTimeout = time.Minute // the held connections outlive a slow machine's waits
	e := tunneltest.StartEdge(t, cfg)
	b := tunneltest.StartBackend(t)
	ac := e.AgentConfig("", b.Addr())
	ac.Subdomain = "prefix"
	tunneltest.StartAgent(t, ac).WaitOnline(t)

	// One request of 2001:db8::1 held in flight, on its connection.
	ctx, cancel := context.WithCancel(context.Background())
	held, done := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, tunneltest.URL("http", "prefix", "/slow"), nil)
		c := visitorFrom(t, e, "127.0.0.4", "2001:db8::1", 2, false)
		c.Timeout = 0 // held until the test ends (ctx), however slow the machine
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
			err = fmt.Errorf("the held request was answered %d %s", resp.StatusCode, resp.Header.Get(mux.ErrorHeader))
		}
		held <- err
	}()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-b.Entered:
	case err := <-held:
		t.Fatal(err)
	case <-time.After(10 * time.Second):
		t.Fatal("the held request did not reach the local service within 10s")
	}

	// Its neighbour in the /64 is at the request bound; another /64 is not.
	tunneltest.Eventually(t, 10*time.Second, "a request of 2001:db8::2 to get 429 while one of 2001:db8::1 is in flight", func() bool {
		return rawVisit(t, e, "2001:db8::2") == http.StatusTooManyRequests
	})
	if got := rawVisit(t, e, "2001:db8:0:1::1"); got != http.StatusOK {
		t.Fatalf("a visitor of another /64: %d, want 200", got)
	}

	// A second connection of the /64, held open, takes its last place (it
	// is counted once answered): a third is closed unanswered; another
	// /64's is served. The connections of the visits above are let go by
	// the edge just after their answers (Connection: close): until it has,
	// one of them still holds that place, and the second is refused.
	var idle net.Conn
	defer func() {
		if idle != nil {
			idle.Close()
		}
	}()
	tunneltest.Eventually(t, 10*time.Second, "a second connection of the /64 to be answered 429 (its request at the bound)", func() bool {
		if idle != nil {
			idle.Close()
		}
		idle = proxiedConn(t, e, "2001:db8::2")
		return visitOn(t, idle, false) == http.StatusTooManyRequests
	})
	tunneltest.Eventually(t, 10*time.Second, "a third connection of the /64 to be refused", func() bool {
		return rawVisit(t, e, "2001:db8::3") == 0
	})
	if got := rawVisit(t, e, "2001:db8:0:1::1"); got != http.StatusOK {
		t.Fatalf("a visitor of another /64, the first one's connections at their bound: %d, want 200", got)
	}
}

// proxiedConn is a connection to e's HTTP listener from the trusted load
// balancer, its PROXY header naming from as the visitor.
func proxiedConn(t *testing.T, e *tunneltest.Edge, from string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.4")}}
	c, err := d.Dial("tcp", e.Addr("http").String())
	if err != nil {
		t.Fatal(err)
	}
	src := net.TCPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(from), 40000))
	if _, err := proxyproto.HeaderProxyFromAddrs(2, src, c.RemoteAddr()).WriteTo(c); err != nil {
		c.Close()
		t.Fatal(err)
	}
	return c
}

// rawVisit sends GET /hello for the tunnel from from, on a connection of
// its own, and returns the status (0: the connection was closed
// unanswered).
func rawVisit(t *testing.T, e *tunneltest.Edge, from string) int {
	t.Helper()
	c := proxiedConn(t, e, from)
	defer c.Close()
	return visitOn(t, c, true)
}

// visitOn sends GET /hello for the tunnel on c, closing it after the
// answer if last, and returns the status (0: c was closed unanswered),
// with the code a 429 must carry.
func visitOn(t *testing.T, c net.Conn, last bool) int {
	t.Helper()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	req := "GET /hello HTTP/1.1\r\nHost: prefix." + tunneltest.Domain + "\r\n"
	if last {
		req += "Connection: close\r\n"
	}
	if _, err := c.Write([]byte(req + "\r\n")); err != nil {
		return 0
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get(mux.ErrorHeader) != mux.CodeVisitorLimit {
		t.Errorf("429 with code %q, want %s", resp.Header.Get(mux.ErrorHeader), mux.CodeVisitorLimit)
	}
	return resp.StatusCode
}
