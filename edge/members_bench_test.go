package edge

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/registry"
)

// BenchmarkPoolPick is what routing adds to a request of a pool of three
// members: choosing the member (pick) over reading a single binding.
func BenchmarkPoolPick(b *testing.B) {
	e := &Edge{sessions: map[uint64]*session{}, metrics: newMetrics(&Edge{})}
	e.cfg.HeartbeatTimeout = time.Hour
	pool := registry.Binding{Hostname: "team.example.com", Pool: true}
	addMembers(b, e, &pool, 3)
	b.ReportAllocs()
	for b.Loop() {
		if _, _, ok := e.pick(pool, nil); !ok {
			b.Fatal("no member picked")
		}
	}
}

// BenchmarkPoolPickCluster is pick in a cluster: one member of this edge
// and two of another, which the registry knows the address of.
func BenchmarkPoolPickCluster(b *testing.B) {
	stores := map[string]*registry.Etcd{}
	prefix := etcdtest.Prefix(b)
	for _, node := range []string{"a", "b"} {
		s := registry.NewEtcd(registry.EtcdConfig{Endpoints: etcdtest.Endpoints(b), Prefix: prefix, Node: node, LeaseTTL: 6 * time.Second})
		if err := s.Start(context.Background(), node+":7443", registry.Hooks{}); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		stores[node] = s
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, ok := stores["a"].NodeAddr("b"); !ok; _, ok = stores["a"].NodeAddr("b") {
		if time.Now().After(deadline) {
			b.Fatal("node a never learned node b's address")
		}
		time.Sleep(time.Millisecond)
	}
	e := &Edge{sessions: map[uint64]*session{}, metrics: newMetrics(&Edge{}),
		cluster: &cluster{store: stores["a"], node: "a", inFlight: map[uint64]int{}}}
	e.cfg.HeartbeatTimeout = time.Hour
	pool := registry.Binding{Hostname: "team.example.com", Pool: true}
	addMembers(b, e, &pool, 1)
	pool.Members[0].Node = "a"
	for gen := uint64(2); gen <= 3; gen++ {
		pool.Members = append(pool.Members, registry.Binding{Hostname: pool.Hostname, SessionID: gen, Generation: gen, Node: "b"})
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, _, ok := e.pick(pool, nil); !ok {
			b.Fatal("no member picked")
		}
	}
}

// addMembers adds n members to pool, each a session of e on a yamux
// session over a pipe.
func addMembers(b *testing.B, e *Edge, pool *registry.Binding, n uint64) {
	ycfg := yamux.DefaultConfig()
	ycfg.LogOutput = io.Discard
	for id := uint64(1); id <= n; id++ {
		c1, c2 := net.Pipe()
		ys, err := yamux.Server(c1, ycfg)
		if err != nil {
			b.Fatal(err)
		}
		yc, _ := yamux.Client(c2, ycfg)
		b.Cleanup(func() { ys.Close(); yc.Close() })
		s := &session{e: e, id: id, ys: ys, closed: make(chan struct{}), bindings: map[string]uint64{pool.Hostname: id}}
		s.lastBeat.Store(time.Now().UnixNano())
		e.sessions[id] = s
		pool.Members = append(pool.Members, registry.Binding{Hostname: pool.Hostname, SessionID: id, Generation: id})
	}
}
