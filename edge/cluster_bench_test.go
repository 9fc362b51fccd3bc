package edge_test

import (
	"context"
	"io"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/registry"
)

// BenchmarkClusterRequest measures a small GET three ways in one run,
// interleaved so that drift hits them alike: to the backend directly,
// through the agent's own edge, and through another edge that forwards it
// one hop. Each visitor keeps its connection alive. It reports the medians
// and what the hop adds.
//
//	go test -run '^$' -bench ClusterRequest -benchtime 3000x ./edge
func BenchmarkClusterRequest(b *testing.B) {
	c := newTestCluster(b)
	a, other := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(b)
	st := startClusterAgent(b, a, "", backend.Addr(), "bench", instX).WaitOnline(b)
	for {
		if r, ok := other.store.Lookup("bench." + tunneltest.Domain); ok && r.Generation == st.Generation {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	url := tunneltest.URL("http", "bench", "/hello")
	direct := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	b.Cleanup(direct.CloseIdleConnections)
	viaA, viaB := a.Client(), other.Client()
	directURL := "http://" + backend.Addr() + "/hello"
	for range 200 { // warm every path's connections and pools
		timeGet(b, direct, directURL)
		timeGet(b, viaA, url)
		timeGet(b, viaB, url)
	}
	var d, l, f []time.Duration
	b.ResetTimer()
	for range b.N {
		d = append(d, timeGet(b, direct, directURL))
		l = append(l, timeGet(b, viaA, url))
		f = append(f, timeGet(b, viaB, url))
	}
	b.StopTimer()
	md, ml, mf := median(d), median(l), median(f)
	b.ReportMetric(us(md), "direct-µs")
	b.ReportMetric(us(ml), "own-edge-µs")
	b.ReportMetric(us(mf), "forwarded-µs")
	b.ReportMetric(us(mf-ml), "hop-adds-µs")
}

// BenchmarkBind measures one bind and its release on each store: the
// in-memory one, and etcd's (a read and a guarded transaction, then a read
// and a guarded delete, against a local single-member etcd).
//
//	go test -run '^$' -bench Bind -benchtime 2000x ./edge
func BenchmarkBind(b *testing.B) {
	ctx := context.Background()
	etcd := registry.NewEtcd(registry.EtcdConfig{Endpoints: etcdtest.Endpoints(b), Prefix: etcdtest.Prefix(b), Node: "bench"})
	if err := etcd.Start(ctx, "bench:7443", registry.Hooks{}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { etcd.Close() })
	if err := etcd.OpenSession(ctx, registry.Session{ID: 1}); err != nil {
		b.Fatal(err)
	}
	for name, s := range map[string]registry.Store{"memory": registry.NewMemory(nil), "etcd": etcd} {
		b.Run(name, func(b *testing.B) {
			c := registry.Claim{Hostname: "bench." + tunneltest.Domain, InstanceID: instX, TokenID: "t", SessionID: 1, Node: "bench"}
			lat := make([]time.Duration, 0, b.N)
			for range b.N {
				start := time.Now()
				res, err := s.Bind(ctx, c)
				if err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
				if ok, err := s.Release(ctx, c.Hostname, 1, res.Binding.Generation); !ok || err != nil {
					b.Fatalf("release: %v, %v", ok, err)
				}
			}
			b.ReportMetric(us(median(lat)), "bind-µs")
		})
	}
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

func timeGet(b *testing.B, c *http.Client, url string) time.Duration {
	start := time.Now()
	resp, err := c.Get(url)
	if err != nil {
		b.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		b.Fatalf("GET %s: %d", url, resp.StatusCode)
	}
	return time.Since(start)
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
