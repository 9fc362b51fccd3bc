package agent_test

import (
	"io"
	"net/http"
	"runtime/metrics"
	"testing"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// BenchmarkGET sends small GETs through an in-process edge and agent over
// loopback, one keep-alive visitor connection per goroutine. Everything
// (visitor, edge, agent, backend) shares one process, so ns/op is not a
// tunnel's latency; allocs/op and B/op are the figures to compare between
// changes of the request path (go test -bench GET -benchmem ./agent), and
// so is goroutines/op, the goroutines started per request (each a hand-off
// at least): the visitor's and the backend's are in it too.
func BenchmarkGET(b *testing.B) {
	for _, run := range []struct{ name, scheme, inspect string }{
		{"http", "http", ""}, {"https", "https", ""},
		// As the CLI runs the agent by default: with its inspector.
		{"http-inspect", "http", "127.0.0.1:0"},
	} {
		scheme := run.scheme
		b.Run(run.name, func(b *testing.B) {
			be := tunneltest.StartBackend(b)
			e := tunneltest.StartEdge(b, tunneltest.EdgeConfig(b))
			cfg := e.AgentConfig("", be.Addr())
			cfg.Subdomain = "bench"
			cfg.InspectAddr = run.inspect
			tunneltest.StartAgent(b, cfg).WaitOnline(b)
			c := e.Client()
			c.Transport.(*http.Transport).ForceAttemptHTTP2 = false
			b.Cleanup(c.CloseIdleConnections)
			url := tunneltest.URL(scheme, "bench", "/hello")
			b.ReportAllocs()
			created := goroutinesCreated()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := c.Get(url)
					if err != nil {
						b.Error(err)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						b.Errorf("status %d", resp.StatusCode)
						return
					}
				}
			})
			b.ReportMetric(float64(goroutinesCreated()-created)/float64(b.N), "goroutines/op")
		})
	}
}

// goroutinesCreated is how many goroutines the process has started.
func goroutinesCreated() uint64 {
	s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
