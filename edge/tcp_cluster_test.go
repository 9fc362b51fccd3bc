package edge_test

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// startTCPCluster starts edges a and b on one etcd, on hosts of their own
// (127.0.0.2 and 127.0.0.3), both listening on the same TCP ports.
func startTCPCluster(t *testing.T, ports int, tune func(*edge.Config)) (c *testCluster, a, b *clusterEdge, start func(name, host string) *clusterEdge) {
	return startTCPClusterWith(t, ports, nil, tune)
}

// startTCPClusterWith is startTCPCluster with the edges' registry
// settings changed by etcd.
func startTCPClusterWith(t *testing.T, ports int, etcd func(*registry.EtcdConfig), tune func(*edge.Config)) (c *testCluster, a, b *clusterEdge, start func(name, host string) *clusterEdge) {
	t.Helper()
	c = newTestCluster(t)
	tcp := tunneltest.FreePorts(t, ports)
	start = func(name, host string) *clusterEdge {
		return c.startWith(name, nil, etcd, func(cfg *edge.Config) {
			cfg.HTTPAddr, cfg.HTTPSAddr = host+":0", host+":0"
			cfg.TCPPorts = tcp
			cfg.TokenPolicies = []edge.TokenPolicy{{Token: "token-a"}, {Token: "token-b"}}
			if tune != nil {
				tune(cfg)
			}
		})
	}
	return c, start("a", "127.0.0.2"), start("b", "127.0.0.3"), start
}

// waitRouted waits until e routes key to the binding of st.
func waitRouted(t *testing.T, e *clusterEdge, key string, st agent.Status) {
	t.Helper()
	tunneltest.Eventually(t, 5*time.Second, e.store.Node()+" to learn of "+key, func() bool {
		r, ok := e.store.Lookup(key)
		return ok && r.Generation == st.Generation
	})
}

func startClusterTCPAgent(t *testing.T, e *clusterEdge, local, token, instance string, remote int) *tunneltest.Agent {
	t.Helper()
	ac := e.AgentConfigShortTimeouts("", local)
	ac.Proto, ac.RemotePort, ac.Token, ac.InstanceID = agent.ProtoTCP, remote, token, instance
	return tunneltest.StartAgent(t, ac)
}

// TestClusterTCPTunnel: a TCP tunnel's agent on edge a; visitors of edge b
// reach it over the hop between the edges, each byte and each half-close
// as on one edge. The port stays token A's across the edges: a new
// instance of A's agent on b gets it back without asking, token B is
// refused it on either edge while A holds or keeps it, and an edge's
// restart changes nothing.
func TestClusterTCPTunnel(t *testing.T) {
	const up, down = 1 << 20, 256 << 10
	local := digestService(t, down)
	_, a, b, start := startTCPCluster(t, 3, nil)
	ag := startClusterTCPAgent(t, a, local, "token-a", instX, 0)
	st := ag.WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)

	relay := func(e *clusterEdge) {
		t.Helper()
		if err := digestVisit(dialTCP(t, e.Edge, port), up, down); err != nil {
			t.Fatalf("via %s: %v", e.store.Node(), err)
		}
	}
	for range 2 {
		relay(b) // forwarded
		relay(a) // local
	}

	refusedB := func(e *clusterEdge) {
		t.Helper()
		err := startClusterTCPAgent(t, e, local, "token-b", instY, port).Err()
		var re *agent.RefusedError
		if !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken || !strings.Contains(re.Message, fmt.Sprintf("port %d", port)) {
			t.Fatalf("token B asking %s for token A's port %d: %v; want %s naming the port", e.store.Node(), port, err, mux.CodeSubdomainTaken)
		}
	}
	refusedB(b)                       // while A holds it
	if err := ag.Stop(); err != nil { // the port is released, and kept
		t.Fatal(err)
	}
	refusedB(b) // while A keeps it
	refusedB(a)

	// A new instance of A's agent, on the other edge, asking for no port.
	ag = startClusterTCPAgent(t, b, local, "token-a", "cccccccccccccccccccccccccccccccc", 0)
	st = ag.WaitOnline(t)
	if got := tcpPort(t, st); got != port {
		t.Fatalf("token A's next agent, on edge b, got port %d, want its port %d back", got, port)
	}
	waitRouted(t, a, mux.TCPKey(port), st)
	relay(a)

	a.Close()
	a = start("a", "127.0.0.2")
	refusedB(a)
	waitRouted(t, a, mux.TCPKey(port), st)
	relay(a)
	other := startClusterTCPAgent(t, a, local, "token-b", instY, 0)
	if got := tcpPort(t, other.WaitOnline(t)); got == port {
		t.Fatalf("token B got token A's port %d", port)
	}
}

// TestClusterTCPProxyProtocol: the PROXY protocol header a local service
// reads names the visitor and the port of the edge it connected to, also
// when that edge is not the agent's.
func TestClusterTCPProxyProtocol(t *testing.T) {
	addr, seen := proxyProtocolService(t)
	_, a, b, _ := startTCPCluster(t, 1, nil)
	ac := a.AgentConfigShortTimeouts("", addr)
	ac.Proto, ac.ProxyProtocol, ac.Token = agent.ProtoTCP, true, "token-a"
	st := tunneltest.StartAgent(t, ac).WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)
	sayHello(t, dialTCP(t, b.Edge, port), b.TCPAddr(port), seen)
}

// TestClusterTCPIdle: a forwarded connection idle for longer than the
// edges' ReadTimeout stays up (its idle bound is TCPIdleTimeout, kept by
// the first edge), and is closed once idle for TCPIdleTimeout.
func TestClusterTCPIdle(t *testing.T) {
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(tcpDeadline))
		echoLines(c)
	})
	const idle = 3 * time.Second
	_, a, b, _ := startTCPCluster(t, 1, func(cfg *edge.Config) {
		cfg.ReadTimeout, cfg.TCPIdleTimeout = 300*time.Millisecond, idle
	})
	st := startClusterTCPAgent(t, a, local, "token-a", instX, 0).WaitOnline(t)
	port := tcpPort(t, st)
	waitRouted(t, b, mux.TCPKey(port), st)
	c := dialTCP(t, b.Edge, port)
	br := bufio.NewReader(c)
	for i := range 3 {
		io.WriteString(c, "ping\n")
		if line, err := br.ReadString('\n'); err != nil || line != "echo: ping\n" {
			t.Fatalf("after %d quiet spells over the read timeout: %q, %v", i, line, err)
		}
		time.Sleep(600 * time.Millisecond) // quiet: twice the read timeout
	}
	began := time.Now()
	if _, err := br.ReadString('\n'); err == nil {
		t.Fatal("read a line from an idle connection")
	}
	if waited := time.Since(began); waited < idle/2 {
		t.Fatalf("the idle connection was closed after %s, before the idle timeout %s", waited, idle)
	}
}

// TestClusterTLSPassthrough: a TLS passthrough tunnel's agent on edge a;
// a visitor of edge b's HTTPS port reaches the local service's own TLS.
func TestClusterTLSPassthrough(t *testing.T) {
	const name = "secure." + tunneltest.Domain
	cert, roots := tunneltest.SelfSigned(t, name)
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
		tc.SetDeadline(time.Now().Add(tcpDeadline))
		br := bufio.NewReader(tc)
		line, _ := br.ReadString('\n')
		io.WriteString(tc, "echo: "+line)
	})
	_, a, b, _ := startTCPCluster(t, 1, nil)
	ac := a.AgentConfigShortTimeouts("", local)
	ac.Proto, ac.Subdomain, ac.Token = agent.ProtoTLS, "secure", "token-a"
	waitRouted(t, b, name, tunneltest.StartAgent(t, ac).WaitOnline(t))
	for _, e := range []*clusterEdge{b, a} {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", e.Addr("https").String(), &tls.Config{ServerName: name, RootCAs: roots})
		if err != nil {
			t.Fatalf("via %s: %v", e.store.Node(), err)
		}
		c.SetDeadline(time.Now().Add(tcpDeadline))
		io.WriteString(c, "ping\n")
		if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || line != "echo: ping\n" {
			t.Fatalf("via %s: %q, %v", e.store.Node(), line, err)
		}
		c.Close()
	}
}

// TestClusterTCPTakeoverOnOtherEdge: the agent of a TCP tunnel on edge a
// is cut off by a partition that edge a does not notice; its own instance
// takes its port over on edge b (rule 1), while another instance of the
// same token is refused it as long as a's holder is live (rule 3).
func TestClusterTCPTakeoverOnOtherEdge(t *testing.T) {
	local := tunneltest.ServeConns(t, func(c net.Conn) { io.WriteString(c, "hi\n") })
	_, a, b, _ := startTCPCluster(t, 1, func(cfg *edge.Config) { cfg.HeartbeatTimeout = time.Minute })
	lb := controlProxy(t, a)
	ac := a.AgentConfigShortTimeouts(lb.Addr(), local)
	ac.Proto, ac.Token, ac.InstanceID, ac.HeartbeatTimeout = agent.ProtoTCP, "token-a", instX, 300*time.Millisecond
	ag := tunneltest.StartAgent(t, ac)
	before := ag.WaitOnline(t)
	port := tcpPort(t, before)

	other := startClusterTCPAgent(t, b, local, "token-a", instY, port)
	var re *agent.RefusedError
	if err := other.Err(); !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken {
		t.Fatalf("another instance on b asking for port %d: %v; want %s while a's holder is live", port, err, mux.CodeSubdomainTaken)
	}

	lb.DelayExisting(time.Hour) // the partition
	lb.SetTarget(b.Addr("control").String())
	after := ag.WaitStatus(t, 10*time.Second, "online again, through b", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.SessionID != before.SessionID
	})
	if got := tcpPort(t, after); got != port || after.Generation <= before.Generation {
		t.Fatalf("after the move: port %d generation %d; before: port %d generation %d", got, after.Generation, port, before.Generation)
	}
	waitRouted(t, a, mux.TCPKey(port), after)
	for _, e := range []*clusterEdge{a, b} {
		if got, err := io.ReadAll(dialTCP(t, e.Edge, port)); err != nil || string(got) != "hi\n" {
			t.Fatalf("via %s after the move: %q, %v", e.store.Node(), got, err)
		}
	}
}

// TestClusterTCPConnectCloseLoop: TestTCPConnectCloseLoop's visitors, on
// the edge that is not the agent's. The route staleness is the CLI's
// default lease's (10 s, a fifth of it) doubled: under -race on a loaded
// machine an etcd read can take longer than the tests' 1 s, and the edge
// then refuses to route (as it must); that is not what this test is for.
func TestClusterTCPConnectCloseLoop(t *testing.T) {
	serve := func(c net.Conn) { c.Write([]byte{'!'}) } // and races the visitor's close
	connectCloseLoop(t, 512, serve, func(local string) string {
		_, a, b, _ := startTCPClusterWith(t, 1, func(ec *registry.EtcdConfig) { ec.RouteStaleness = 4 * time.Second }, nil)
		st := startClusterTCPAgent(t, a, local, "token-a", instX, 0).WaitOnline(t)
		port := tcpPort(t, st)
		waitRouted(t, b, mux.TCPKey(port), st)
		return b.TCPAddr(port).String()
	})
}
