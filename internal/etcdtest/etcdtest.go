// Package etcdtest runs one embedded etcd server per test binary, on
// loopback, with fast ticks and no fsync, for the tests of the cluster
// registry and of edges that share it, and clusters of several members of
// a test's own (StartCluster) for faults between them. It is imported
// only by tests: the etcd server is never linked into the ngstone binary.
//
// Each test takes its own key prefix (Prefix), so tests share the server
// without seeing each other's keys.
package etcdtest

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"golang.org/x/crypto/bcrypt"
	"google.golang.org/grpc/grpclog"
)

var (
	once     sync.Once
	server   *embed.Etcd
	dir      string
	startErr error
	prefixes atomic.Uint64
)

// The JSON gateway logs through grpclog ("Failed to flush response" when
// a watching client leaves, and gRPC's own lines about every connection a
// fault test breaks). Set before any gRPC goroutine runs: it is global.
func init() {
	grpclog.SetLoggerV2(grpclog.NewLoggerV2(io.Discard, io.Discard, io.Discard))
}

// Main runs m, stops the server if a test started it, and then checks
// that no goroutine leaked, like goleak.VerifyTestMain.
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	Stop()
	if code == 0 {
		if err := settled(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// settled is goleak.Find, looking again for up to 10 s: a peer connection
// to a member that stopped (Cluster.Kill) ends only at etcd's peer read
// timeout, 5 s.
func settled(opts ...goleak.Option) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Endpoints starts the shared server on first use and returns its client
// URLs.
func Endpoints(tb testing.TB) []string {
	tb.Helper()
	once.Do(start)
	if startErr != nil {
		tb.Fatalf("embedded etcd: %v", startErr)
	}
	var out []string
	for _, l := range server.Clients {
		out = append(out, "http://"+l.Addr().String())
	}
	return out
}

// Client returns a client of the shared server, closed when tb ends.
func Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	return ClientAt(tb, Endpoints(tb)...)
}

// ClientAt returns a client of the given endpoints (the shared server's,
// or a proxy in front of it), closed when tb ends.
func ClientAt(tb testing.TB, endpoints ...string) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		tb.Fatalf("etcd client: %v", err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// Prefix returns a key prefix no other test uses.
func Prefix(tb testing.TB) string {
	name := strings.NewReplacer("/", "_", " ", "_").Replace(tb.Name())
	return fmt.Sprintf("/t/%s-%d/", name, prefixes.Add(1))
}

func start() {
	dir, startErr = os.MkdirTemp("", "ngstone-etcd-")
	if startErr != nil {
		return
	}
	server, startErr = startServer(dir)
}

// startServer runs a single-member etcd with its data in dir.
func startServer(dir string) (*embed.Etcd, error) {
	cfg, err := memberConfig("test", dir)
	if err != nil {
		return nil, err
	}
	cfg.TickMs = 10
	cfg.ElectionMs = 50
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	return e, ready(e)
}

// memberConfig is a member on loopback ports of its own, with no fsync
// and the cheapest password hashing.
func memberConfig(name, dir string) (*embed.Config, error) {
	cfg := embed.NewConfig()
	cfg.Name = name
	cfg.Dir = dir
	cfg.UnsafeNoFsync = true
	cfg.BcryptCost = uint(bcrypt.MinCost)
	cfg.LogLevel = "error"
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	// Named ports, not :0: the JSON gateway dials the client URL itself,
	// and the peer URL must be named exactly in the initial cluster.
	client, err := freeURL()
	if err != nil {
		return nil, err
	}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = client, client
	peer, err := freeURL()
	if err != nil {
		return nil, err
	}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = peer, peer
	return cfg, nil
}

func ready(e *embed.Etcd) error {
	select {
	case <-e.Server.ReadyNotify():
		return nil
	case <-time.After(30 * time.Second):
		e.Close()
		return fmt.Errorf("not ready within 30s")
	}
}

// StartSeparate runs an etcd of the test's own, for a test that changes
// server-wide settings (auth), and stops it when the test ends. It returns
// the client URLs.
func StartSeparate(tb testing.TB) []string {
	tb.Helper()
	e, err := startServer(tb.TempDir())
	if err != nil {
		tb.Fatalf("embedded etcd: %v", err)
	}
	tb.Cleanup(func() {
		e.Close()
		<-e.Server.StopNotify()
	})
	var out []string
	for _, l := range e.Clients {
		out = append(out, "http://"+l.Addr().String())
	}
	return out
}

// Stop stops the server, if a test started it. A TestMain that cannot use
// Main calls it before checking for leaked goroutines.
func Stop() {
	if server != nil {
		server.Close()
		<-server.Server.StopNotify()
		server = nil
	}
	if dir != "" {
		os.RemoveAll(dir)
		dir = ""
	}
}

// Members listen on ports below the kernel's ephemeral range (32768 and
// up by default), and below the range the process tests take (20000 and
// up), so that no outgoing connection of a test running beside takes one
// as its source port between the check and the member's listen: a member
// that cannot listen fails its cluster's start.
const portsFrom, portsTo = 12000, 20000

var (
	portsMu    sync.Mutex
	handedOut  = map[int]bool{} // never the same port twice in a process
	errNoPorts = errors.New("etcdtest: no free loopback port below the ephemeral range")
)

// freeURL picks a free loopback port.
func freeURL() ([]url.URL, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 10000 {
		p := portsFrom + rand.IntN(portsTo-portsFrom)
		if handedOut[p] {
			continue
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			continue
		}
		ln.Close()
		handedOut[p] = true
		return []url.URL{{Scheme: "http", Host: addr}}, nil
	}
	return nil, errNoPorts
}
