package edge

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/registry"
)

// BenchmarkPoolPick is what routing adds to a request of a pool of three
// members: choosing the member (pick) over reading a single binding.
func BenchmarkPoolPick(b *testing.B) {
	e := &Edge{sessions: map[uint64]*session{}, metrics: newMetrics(&Edge{})}
	e.cfg.HeartbeatTimeout = time.Hour
	pool := registry.Binding{Hostname: "team.example.com", Pool: true}
	ycfg := yamux.DefaultConfig()
	ycfg.LogOutput = io.Discard
	for id := uint64(1); id <= 3; id++ {
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
	b.ReportAllocs()
	for b.Loop() {
		if _, _, ok := e.pick(pool, nil); !ok {
			b.Fatal("no member picked")
		}
	}
}
