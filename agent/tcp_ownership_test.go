package agent_test

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// The ownership bars of names, for TCP ports, on an edge that runs alone
// (in a cluster: edge/tcp_cluster_test.go).

// tcpEdge is an edge with short timeouts and n TCP ports.
func tcpEdge(t *testing.T, n int) *tunneltest.Edge {
	cfg := edgeConfig(t, "memory")
	cfg.TCPPorts = tunneltest.FreePorts(t, n)
	return tunneltest.StartEdge(t, cfg)
}

// tcpAgentConfig is a TCP tunnel's agent with short timeouts, through
// edgeAddr (empty: e's control address).
func tcpAgentConfig(e *tunneltest.Edge, edgeAddr, local string, remote int) agent.Config {
	cfg := e.AgentConfigShortTimeouts(edgeAddr, local)
	cfg.Proto, cfg.RemotePort = agent.ProtoTCP, remote
	return cfg
}

func portOf(t *testing.T, s agent.Status) int {
	t.Helper()
	p, ok := mux.ParseTCPKey(s.Tunnels[0].Hostname)
	if !ok {
		t.Fatalf("tunnel %q is not a TCP port", s.Tunnels[0].Hostname)
	}
	return p
}

// readsHello reports whether a connection to port p gets the local
// service's greeting within a second.
func readsHello(e *tunneltest.Edge, p int) bool {
	c, err := net.DialTimeout("tcp", e.TCPAddr(p).String(), time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	b, _ := io.ReadAll(c)
	return string(b) == "hello\n"
}

func helloService(t *testing.T) string {
	return tunneltest.ServeConns(t, func(c net.Conn) { io.WriteString(c, "hello\n") })
}

// TestTCPPartitionGetsPortBack: the path goes silent while the edge still
// believes the old session live; when the network returns the agent has
// its port back at once: same instance, a new session, a higher generation.
func TestTCPPartitionGetsPortBack(t *testing.T) {
	cfg := edgeConfig(t, "memory")
	cfg.TCPPorts = tunneltest.FreePorts(t, 2)
	cfg.HeartbeatTimeout = time.Minute // the edge will not notice the partition
	e := tunneltest.StartEdge(t, cfg)
	p := newProxy(t, e)
	ac := tcpAgentConfig(e, p.Addr(), helloService(t), 0)
	ac.HeartbeatTimeout = 300 * time.Millisecond
	a := tunneltest.StartAgent(t, ac)
	before := a.WaitOnline(t)
	port := portOf(t, before)
	key := mux.TCPKey(port)

	p.Block()
	a.WaitStatus(t, 5*time.Second, "the agent to notice", func(s agent.Status) bool { return s.State == agent.StateReconnecting })
	if tn := tunnel(t, e, key); !tn.Online || tn.SessionID != before.SessionID {
		t.Fatalf("the edge should still believe the zombie live: %+v", tn)
	}
	p.Unblock()
	tunneltest.Eventually(t, 5*time.Second, "a visitor connection to get through", func() bool { return readsHello(e, port) })
	after := a.WaitOnline(t)
	tn := tunnel(t, e, key)
	if portOf(t, after) != port || tn.InstanceID != mux.InstanceDigest(a.InstanceID()) || tn.SessionID == before.SessionID || tn.Generation <= before.Generation {
		t.Fatalf("after return: port %d, %+v; before: port %d session %d generation %d", portOf(t, after), tn, port, before.SessionID, before.Generation)
	}
}

// TestTCPPortRefusedWhileLive: another instance asking for a live
// holder's port is refused subdomain_taken and the holder keeps it; one
// asking for no port (the same local address, so the same port kept for
// the token) gets another port.
func TestTCPPortRefusedWhileLive(t *testing.T) {
	e := tcpEdge(t, 2)
	local := helloService(t)
	a := tunneltest.StartAgent(t, tcpAgentConfig(e, "", local, 0))
	port := portOf(t, a.WaitOnline(t))

	other := tunneltest.StartAgent(t, tcpAgentConfig(e, "", local, port))
	var re *agent.RefusedError
	if err := other.Err(); !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken {
		t.Fatalf("another instance asking for port %d: %v, want %s", port, err, mux.CodeSubdomainTaken)
	}
	if tn := tunnel(t, e, mux.TCPKey(port)); tn.InstanceID != mux.InstanceDigest(a.InstanceID()) {
		t.Fatalf("the holder changed: %+v", tn)
	}
	third := tunneltest.StartAgent(t, tcpAgentConfig(e, "", local, 0))
	if got := portOf(t, third.WaitOnline(t)); got == port {
		t.Fatalf("another instance asking for no port got the live holder's %d", port)
	}
	if !readsHello(e, port) {
		t.Fatal("the holder's port no longer answers")
	}
}
