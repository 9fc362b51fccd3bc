package tunneltest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// Domain is the edge domain tests use.
const Domain = "ngstone.test"

// Logger returns a logger for tests: discarded unless NGSTONE_TEST_LOG is
// set, then text to stderr at debug level.
func Logger() *slog.Logger {
	if os.Getenv("NGSTONE_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// EdgeConfig returns what `ngstone edge --domain Domain` runs (the same
// defaults: timeouts, windows, limits), on loopback ports and a data
// directory of the test's own.
func EdgeConfig(t testing.TB) edge.Config {
	cfg := edge.DefaultConfig()
	cfg.Domain = Domain
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.HTTPSAddr = "127.0.0.1:0"
	cfg.ControlAddr = "127.0.0.1:0"
	cfg.AdminAddr = "127.0.0.1:0"
	cfg.TLS.DataDir = t.TempDir()
	return cfg
}

// EdgeConfigShortTimeouts is EdgeConfig with the freshness window, drain,
// hello and shutdown bounds cut to 2 s, for tests of liveness, takeover
// and draining. Its agents want AgentConfigShortTimeouts: an agent on the
// default 15 s heartbeat would look dead to it.
func EdgeConfigShortTimeouts(t testing.TB) edge.Config {
	cfg := EdgeConfig(t)
	cfg.HeartbeatTimeout = 2 * time.Second
	cfg.DrainTimeout = 2 * time.Second
	cfg.HelloTimeout = 2 * time.Second
	cfg.ShutdownGrace = 2 * time.Second
	return cfg
}

// Edge is a running edge with helpers to reach it.
type Edge struct {
	*edge.Edge
	Config edge.Config
	Roots  *x509.CertPool
}

// StartEdge starts an edge from cfg and closes it at the end of the test.
func StartEdge(t testing.TB, cfg edge.Config) *Edge {
	t.Helper()
	e, err := edge.New(cfg, Logger().With("side", "edge"))
	if err != nil {
		t.Fatalf("edge.New: %v", err)
	}
	if err := e.Start(context.Background()); err != nil {
		t.Fatalf("edge.Start: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	pem, err := os.ReadFile(e.CAFile())
	if err != nil {
		t.Fatalf("read CA: %v", err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	return &Edge{Edge: e, Config: cfg, Roots: roots}
}

// AgentConfig returns what `ngstone http LOCAL --edge EDGE` runs (the same
// defaults: inspector on, timeouts, windows), for edge addr (empty: e's
// control address) and local.
func (e *Edge) AgentConfig(edgeAddr, local string) agent.Config {
	cfg := agent.DefaultConfig()
	cfg.Edge = edgeAddr
	if cfg.Edge == "" {
		cfg.Edge = e.Addr("control").String()
	}
	cfg.Local = local
	cfg.RootCAs = e.Roots
	return cfg
}

// AgentConfigShortTimeouts is AgentConfig with millisecond-scale liveness
// (a 50 ms heartbeat, given up after 1 s), 1 s dials and a 2 s drain, for
// tests of reconnects, dead peers and takeovers.
func (e *Edge) AgentConfigShortTimeouts(edgeAddr, local string) agent.Config {
	cfg := e.AgentConfig(edgeAddr, local)
	cfg.HeartbeatInterval = 50 * time.Millisecond
	cfg.HeartbeatTimeout = time.Second
	cfg.DialTimeout = time.Second
	cfg.BackoffBase = 100 * time.Millisecond
	cfg.BackoffCap = time.Second
	cfg.DrainTimeout = 2 * time.Second
	cfg.UpstreamDialTimeout = time.Second
	return cfg
}

// Agent is a running agent.
type Agent struct {
	*agent.Agent
	cancel context.CancelFunc
	done   chan struct{}
	err    error

	mu      sync.Mutex
	history []agent.Status
	changed chan struct{}
}

// StartAgent runs an agent until the test ends (or Stop). An agent on the
// default inspector address gets its inspector on a free loopback port.
func StartAgent(t testing.TB, cfg agent.Config) *Agent {
	t.Helper()
	return StartAgentLogged(t, cfg, Logger().With("side", "agent"))
}

// StartAgentLogged is StartAgent with the agent's logs to log.
func StartAgentLogged(t testing.TB, cfg agent.Config, log *slog.Logger) *Agent {
	t.Helper()
	ta := &Agent{done: make(chan struct{}), changed: make(chan struct{})}
	if cfg.InspectAddr == agent.DefaultInspectAddr {
		// The same inspector on a free port: tests run side by side, and
		// 4040-4049 are the user's (and the CLI tests' processes').
		cfg.InspectAddr, cfg.InspectPorts = "127.0.0.1:0", 0
	}
	prev := cfg.OnStatus
	cfg.OnStatus = func(s agent.Status) {
		ta.mu.Lock()
		ta.history = append(ta.history, s)
		close(ta.changed)
		ta.changed = make(chan struct{})
		ta.mu.Unlock()
		if prev != nil {
			prev(s)
		}
	}
	a, err := agent.New(cfg, log)
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	ta.Agent = a
	ctx, cancel := context.WithCancel(context.Background())
	ta.cancel = cancel
	go func() {
		defer close(ta.done)
		ta.err = a.Run(ctx)
	}()
	t.Cleanup(func() { ta.Stop() })
	return ta
}

// Captures lists what an agent's inspector at base kept (GET /api/requests).
func Captures(t testing.TB, base string) []agent.Capture {
	t.Helper()
	resp, err := http.Get(base + "/api/requests")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list []agent.Capture
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	return list
}

// Stop cancels the agent (a graceful unbind) and returns Run's error.
func (a *Agent) Stop() error {
	a.cancel()
	<-a.done
	return a.err
}

// Done is closed when Run has returned.
func (a *Agent) Done() <-chan struct{} { return a.done }

// Err is Run's error once Done is closed.
func (a *Agent) Err() error {
	<-a.done
	return a.err
}

// WaitStatus waits until the agent's status satisfies ok, or fails the test.
func (a *Agent) WaitStatus(t testing.TB, timeout time.Duration, what string, ok func(agent.Status) bool) agent.Status {
	t.Helper()
	deadline := time.After(timeout)
	for {
		a.mu.Lock()
		ch := a.changed
		a.mu.Unlock()
		if s := a.Status(); ok(s) {
			return s
		}
		select {
		case <-ch:
		case <-a.done:
			if s := a.Status(); ok(s) {
				return s
			}
			t.Fatalf("agent stopped (err %v) before %s; status %+v", a.err, what, a.Status())
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s; status %+v", timeout, what, a.Status())
		}
	}
}

// WaitOnline waits for the agent to be online.
func (a *Agent) WaitOnline(t testing.TB) agent.Status {
	t.Helper()
	return a.WaitStatus(t, 10*time.Second, "online", func(s agent.Status) bool { return s.State == agent.StateOnline })
}

// Client returns an HTTP client that sends every request to the edge's
// listener for the URL's scheme, whatever host it names, trusting the
// edge's CA. Connections are not reused across tests.
func (e *Edge) Client() *http.Client {
	d := &net.Dialer{Timeout: 5 * time.Second}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return d.DialContext(ctx, network, e.addrFor(addr))
		},
		TLSClientConfig:   &tls.Config{RootCAs: e.Roots},
		ForceAttemptHTTP2: true,
	}
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// addrFor maps a URL's host:port to the edge listener: port 443 means the
// HTTPS listener, anything else the HTTP one.
func (e *Edge) addrFor(addr string) string {
	_, port, _ := net.SplitHostPort(addr)
	if port == "443" {
		return e.Addr("https").String()
	}
	return e.Addr("http").String()
}

// URL returns scheme://NAME.Domain/path with the default port, which
// Client maps to the right listener.
func URL(scheme, name, path string) string {
	return fmt.Sprintf("%s://%s.%s%s", scheme, name, Domain, path)
}

// Eventually polls cond every few milliseconds until it holds or timeout.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Stores names the registries the ownership tests run against: the edge's
// own in-memory store, and etcd (an edge in a cluster of one).
var Stores = []string{"memory", "etcd"}

// UseStore puts cfg's edge on the named store; for "etcd", the shared
// embedded etcd of internal/etcdtest, under a key prefix of the test's own.
func UseStore(t testing.TB, cfg *edge.Config, store string) {
	t.Helper()
	UseStoreAt(t, cfg, store, nil)
}

// UseStoreAt is UseStore with etcd reached at endpoints (a fault proxy in
// front of etcdtest's server); nil means etcdtest.Endpoints.
func UseStoreAt(t testing.TB, cfg *edge.Config, store string, endpoints []string) {
	t.Helper()
	if endpoints == nil && store == "etcd" {
		endpoints = etcdtest.Endpoints(t)
	}
	switch store {
	case "memory":
	case "etcd":
		s := registry.NewEtcd(registry.EtcdConfig{Endpoints: endpoints, Prefix: etcdtest.Prefix(t), Node: "edge-1",
			LeaseTTL: 6 * time.Second, RetryInterval: 50 * time.Millisecond, CallTimeout: time.Second, RouteStaleness: time.Second,
			Log: Logger().With("side", "registry")})
		cfg.Cluster = &edge.ClusterConfig{Store: s, Addr: "127.0.0.1:0", Key: strings.Repeat("k", edge.MinClusterKey)}
	default:
		t.Fatalf("unknown store %q", store)
	}
}

// Goroutines counts the goroutines of this process but those that keep
// net/http's idle client connections (an agent's connections to its local
// service): a leak shows in the rest, while the pool may hold a few.
func Goroutines() int {
	n := 0
	for g := range strings.SplitSeq(Stacks(), "\n\n") {
		if !strings.Contains(g, "net/http.(*persistConn).readLoop") && !strings.Contains(g, "net/http.(*persistConn).writeLoop") {
			n++
		}
	}
	return n
}

// Stacks returns the stacks of all of this process's goroutines, whole.
func Stacks() string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return string(buf[:n])
		}
		buf = make([]byte, 2*len(buf))
	}
}

// FreePorts returns n loopback TCP ports free at the time of the call,
// each a range of its own, for an edge's TCPPorts. They are below the
// kernel's ephemeral range (32768 and up by default), so that no
// connection of another test takes one as its source port while an edge
// restarts on it, below the CLI tests' (20000 and up), and never the same
// one twice in a process.
func FreePorts(t testing.TB, n int) []mux.PortRange {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	var out []mux.PortRange
	for try := 0; len(out) < n; try++ {
		if try == 10000 {
			t.Fatalf("no %d free loopback ports from %d to %d", n, portsFrom, portsTo)
		}
		p := portsFrom + mrand.IntN(portsTo-portsFrom)
		if handedOut[p] {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		ln.Close()
		handedOut[p] = true
		out = append(out, mux.PortRange{Lo: p, Hi: p})
	}
	return out
}

// The ports FreePorts hands out.
const portsFrom, portsTo = 10000, 20000

var (
	portsMu   sync.Mutex
	handedOut = map[int]bool{}
)

// TCPAgentConfig is AgentConfig for `ngstone tcp LOCAL`: a TCP tunnel to
// local, on the public port remote (0: the edge's choice).
func (e *Edge) TCPAgentConfig(local string, remote int) agent.Config {
	cfg := e.AgentConfig("", local)
	cfg.Proto, cfg.RemotePort = agent.ProtoTCP, remote
	return cfg
}

// SelfSigned returns a certificate of its own for names, and a pool that
// trusts it: a local service's that the edge does not know.
func SelfSigned(t testing.TB, names ...string) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: names[0]},
		DNSNames:     names,
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}
