package agent_test

import (
	"io"
	"net/http"
	"testing"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// BenchmarkGET sends small GETs through an in-process edge and agent over
// loopback, one keep-alive visitor connection per goroutine. Everything
// (visitor, edge, agent, backend) shares one process, so ns/op is not a
// tunnel's latency; allocs/op and B/op are the figures to compare between
// changes of the request path (go test -bench GET -benchmem ./agent).
func BenchmarkGET(b *testing.B) {
	for _, scheme := range []string{"http", "https"} {
		b.Run(scheme, func(b *testing.B) {
			be := tunneltest.StartBackend(b)
			e := tunneltest.StartEdge(b, tunneltest.EdgeConfig(b))
			cfg := e.AgentConfig("", be.Addr())
			cfg.Subdomain = "bench"
			tunneltest.StartAgent(b, cfg).WaitOnline(b)
			c := e.Client()
			c.Transport.(*http.Transport).ForceAttemptHTTP2 = false
			b.Cleanup(c.CloseIdleConnections)
			url := tunneltest.URL(scheme, "bench", "/hello")
			b.ReportAllocs()
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
		})
	}
}
