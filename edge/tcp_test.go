package edge_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// tcpDeadline bounds every read and write of these tests, so that a
// broken relay fails the test with a message instead of hanging it.
const tcpDeadline = 20 * time.Second

// startTCPTunnel starts an edge with ports TCP ports and an agent of a TCP
// tunnel to local, and returns the edge and the public port it was given.
func startTCPTunnel(t *testing.T, ports int, local string) (*tunneltest.Edge, int) {
	t.Helper()
	cfg := tunneltest.EdgeConfig(t)
	cfg.TCPPorts = tunneltest.FreePorts(t, ports)
	e := tunneltest.StartEdge(t, cfg)
	a := tunneltest.StartAgent(t, e.TCPAgentConfig(local, 0))
	return e, tcpPort(t, a.WaitOnline(t))
}

// tcpPort is the public port of the agent's one tunnel.
func tcpPort(t testing.TB, s agent.Status) int {
	t.Helper()
	p, ok := mux.ParseTCPKey(s.Tunnels[0].Hostname)
	if !ok || !strings.HasPrefix(s.Tunnels[0].URL, "tcp://"+tunneltest.Domain+":") {
		t.Fatalf("tunnel %q at %q: not a TCP port", s.Tunnels[0].Hostname, s.Tunnels[0].URL)
	}
	return p
}

// dialTCP connects to the edge's public TCP port p.
func dialTCP(t testing.TB, e *tunneltest.Edge, p int) *net.TCPConn {
	t.Helper()
	addr := e.TCPAddr(p)
	if addr == nil {
		t.Fatalf("the edge does not listen on port %d", p)
	}
	c, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(tcpDeadline))
	return c.(*net.TCPConn)
}

// TestTCPTunnelHalfClosesBothWays: a local service that speaks first,
// then reads to the visitor's half-close, answers with a digest and 1 MiB
// and closes: each byte crosses as sent, and each half-close as made.
func TestTCPTunnelHalfClosesBothWays(t *testing.T) {
	const up, down = 3 << 20, 1 << 20
	e, port := startTCPTunnel(t, 2, digestService(t, down))
	for round := range 3 { // each on a stream of its own
		if err := digestVisit(dialTCP(t, e, port), up, down); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
	}
}

// digestService is a local service that speaks first ("banner\n"), reads
// to the visitor's half-close, answers with the SHA-256 of what it read
// and down bytes of the pattern, and closes.
func digestService(t *testing.T, down int64) string {
	return tunneltest.ServeConns(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(tcpDeadline))
		io.WriteString(c, "banner\n")
		h := sha256.New()
		if _, err := io.Copy(h, c); err != nil {
			return
		}
		c.Write(h.Sum(nil))
		io.Copy(c, tunneltest.Pattern(down))
	})
}

// digestVisit is a visitor of digestService on c: the banner, up bytes
// sent and a half-close, then the digest and down bytes to the end.
func digestVisit(c *net.TCPConn, up, down int64) error {
	banner := make([]byte, 7)
	if _, err := io.ReadFull(c, banner); err != nil || string(banner) != "banner\n" {
		return fmt.Errorf("banner %q, %v", banner, err)
	}
	want := sha256.New()
	if _, err := io.Copy(io.MultiWriter(c, want), tunneltest.Pattern(up)); err != nil {
		return fmt.Errorf("upload: %w", err)
	}
	if err := c.CloseWrite(); err != nil {
		return err
	}
	got, err := io.ReadAll(c)
	pattern, _ := io.ReadAll(tunneltest.Pattern(down))
	if err != nil || int64(len(got)) != sha256.Size+down || !bytes.Equal(got[:sha256.Size], want.Sum(nil)) || !bytes.Equal(got[sha256.Size:], pattern) {
		return fmt.Errorf("got %d bytes, %v; want the upload's digest and %d bytes of the pattern", len(got), err, down)
	}
	return nil
}

// TestTCPServiceCloseEndsConnection: a local service that closes first
// (an answer, then close) gives the visitor that answer and the end of the
// stream, while the visitor has not half-closed.
func TestTCPServiceCloseEndsConnection(t *testing.T) {
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		io.WriteString(c, "bye\n")
	})
	e, port := startTCPTunnel(t, 1, local)
	c := dialTCP(t, e, port)
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "bye\n" {
		t.Fatalf("got %q, %v; want bye and the end", got, err)
	}
}

// TestTCPPortStaysTheTokens: a port given to token A comes back to A's
// next agent (a new instance, asking for no port), across an edge restart
// on the same registry file; token B is refused it meanwhile, and gets
// another when it asks for none.
func TestTCPPortStaysTheTokens(t *testing.T) {
	local := tunneltest.ServeConns(t, func(c net.Conn) { io.WriteString(c, "hi\n") })
	cfg := tunneltest.EdgeConfig(t)
	cfg.TCPPorts = tunneltest.FreePorts(t, 3)
	cfg.RegistryFile = filepath.Join(t.TempDir(), "registry.db")
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "token-a"}, {Token: "token-b"}}
	e := tunneltest.StartEdge(t, cfg)
	start := func(e *tunneltest.Edge, token string, remote int) *tunneltest.Agent {
		ac := e.TCPAgentConfig(local, remote)
		ac.Token = token
		return tunneltest.StartAgent(t, ac)
	}
	a := start(e, "token-a", 0)
	port := tcpPort(t, a.WaitOnline(t))
	if err := a.Stop(); err != nil { // a graceful stop: the port is released
		t.Fatal(err)
	}
	refusedB := func(e *tunneltest.Edge) {
		t.Helper()
		err := start(e, "token-b", port).Err()
		var re *agent.RefusedError
		if !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken || !strings.Contains(re.Message, fmt.Sprintf("port %d", port)) {
			t.Fatalf("token B asking for token A's port %d: %v; want %s naming the port", port, err, mux.CodeSubdomainTaken)
		}
	}
	refusedB(e)
	a = start(e, "token-a", 0)
	if got := tcpPort(t, a.WaitOnline(t)); got != port {
		t.Fatalf("token A's next agent got port %d, want its port %d back", got, port)
	}
	refusedB(e) // while A holds it, too

	a.Stop()
	e.Close()
	e = tunneltest.StartEdge(t, cfg)
	refusedB(e)
	a = start(e, "token-a", 0)
	if got := tcpPort(t, a.WaitOnline(t)); got != port {
		t.Fatalf("after the edge's restart, token A's agent got port %d, want %d", got, port)
	}
	b := start(e, "token-b", 0)
	if got := tcpPort(t, b.WaitOnline(t)); got == port {
		t.Fatalf("token B got token A's port %d", port)
	}
	c := dialTCP(t, e, port)
	if line, err := io.ReadAll(c); err != nil || string(line) != "hi\n" {
		t.Fatalf("through the port after the restart: %q, %v", line, err)
	}
}

// BenchmarkTCPDownload: 64 MiB from a local service through a TCP
// tunnel, for profiles (the bench's tcp phase has the figures).
func BenchmarkTCPDownload(b *testing.B) {
	const size = 64 << 20
	local := tunneltest.ServeConns(b, func(c net.Conn) { io.Copy(c, io.LimitReader(tunneltest.Pattern(size), size)) })
	cfg := tunneltest.EdgeConfig(b)
	cfg.TCPPorts = tunneltest.FreePorts(b, 1)
	e := tunneltest.StartEdge(b, cfg)
	a := tunneltest.StartAgent(b, e.TCPAgentConfig(local, 0))
	port := tcpPort(b, a.WaitOnline(b))
	b.SetBytes(size)
	for b.Loop() {
		c := dialTCP(b, e, port)
		if n, err := io.Copy(io.Discard, c); err != nil || n != size {
			b.Fatalf("%d bytes, %v", n, err)
		}
		c.Close()
	}
}

// TestTCPConnectCloseLoop: visitors that connect, read the local
// service's first byte and close at once, one after another and 64 at a
// time: each gets its byte, also when the local service closes as the
// visitor does (a stream is never taken again while the agent closes it).
func TestTCPConnectCloseLoop(t *testing.T) {
	for name, serve := range map[string]func(net.Conn){
		"service waits":  func(c net.Conn) { c.Write([]byte{'!'}); c.Read(make([]byte, 1)) },
		"service closes": func(c net.Conn) { c.Write([]byte{'!'}) }, // and races the visitor's close
	} {
		t.Run(name, func(t *testing.T) {
			connectCloseLoop(t, 2000, serve, func(local string) string {
				e, port := startTCPTunnel(t, 1, local)
				return e.TCPAddr(port).String()
			})
		})
	}
}

// connectCloseLoop runs n connections one after another, then n 64 at a
// time, to the address that tunnel returns, of a TCP tunnel to a local
// service that serves each connection so.
func connectCloseLoop(t *testing.T, n int, serve func(net.Conn), tunnel func(local string) string) {
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(tcpDeadline))
		serve(c)
	})
	addr := tunnel(local)
	for _, conc := range []int{1, 64} {
		var wg sync.WaitGroup
		errs := make(chan error, conc)
		for range conc {
			wg.Go(func() {
				for range n / conc {
					c, err := net.DialTimeout("tcp", addr, 5*time.Second)
					if err != nil {
						errs <- err
						return
					}
					c.SetDeadline(time.Now().Add(10 * time.Second))
					_, err = io.ReadFull(c, make([]byte, 1))
					c.Close()
					if err != nil {
						errs <- fmt.Errorf("first byte: %w", err)
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("c=%d: %v", conc, err)
		}
	}
}

// TestTCPProxyProtocol: with ProxyProtocol the local service reads a PROXY
// protocol v2 header naming the visitor's address and the edge's port it
// connected to, then the visitor's bytes.
func TestTCPProxyProtocol(t *testing.T) {
	addr, seen := proxyProtocolService(t)
	cfg := tunneltest.EdgeConfig(t)
	cfg.TCPPorts = tunneltest.FreePorts(t, 1)
	e := tunneltest.StartEdge(t, cfg)
	ac := e.TCPAgentConfig(addr, 0)
	ac.ProxyProtocol = true
	port := tcpPort(t, tunneltest.StartAgent(t, ac).WaitOnline(t))
	sayHello(t, dialTCP(t, e, port), e.TCPAddr(port), seen)
}

// proxyProtocolService is a local service that requires a PROXY protocol
// header: for its first connection it sends on seen the source and
// destination the header named, and the first line after it.
func proxyProtocolService(t *testing.T) (string, <-chan string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pln := &proxyproto.Listener{Listener: ln, ConnPolicy: func(proxyproto.ConnPolicyOptions) (proxyproto.Policy, error) { return proxyproto.REQUIRE, nil }}
	t.Cleanup(func() { pln.Close() })
	seen := make(chan string, 1)
	go func() {
		c, err := pln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(tcpDeadline))
		line, _ := bufio.NewReader(c).ReadString('\n')
		seen <- c.RemoteAddr().String() + " " + c.LocalAddr().String() + " " + line
	}()
	return ln.Addr().String(), seen
}

// sayHello sends a line on visitor c, which connected to the edge's
// public address, and checks what the PROXY protocol service saw.
func sayHello(t *testing.T, c net.Conn, public net.Addr, seen <-chan string) {
	t.Helper()
	io.WriteString(c, "hello\n")
	want := c.LocalAddr().String() + " " + public.String() + " hello\n"
	select {
	case got := <-seen:
		if got != want {
			t.Fatalf("the local service saw %q, want %q", got, want)
		}
	case <-time.After(tcpDeadline):
		t.Fatal("the local service read nothing")
	}
}
