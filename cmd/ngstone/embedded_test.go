package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/edge"
)

// TestEmbeddedEdgesStartTogether: `ngstone http` started several times at
// once, on one fresh cache: every embedded edge starts (one on the
// preferred ports, the others on free ones) and each serves a certificate
// of the CA in its ca.pem. The ports
// were looked at before they were listened on, so two could both find
// 8080 free and one then fail to listen.
func TestEmbeddedEdgesStartTogether(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", t.TempDir())
	saved := embeddedAddrs
	t.Cleanup(func() { embeddedAddrs = saved })
	embeddedAddrs = map[string]string{"http": freeLoopback(t), "https": freeLoopback(t)}
	const n = 4
	for round := range 5 {
		edges := make([]*edge.Edge, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { edges[i], errs[i] = startEmbeddedEdge(context.Background(), slog.New(slog.DiscardHandler), 0) })
		}
		wg.Wait()
		seen := map[string]bool{}
		for i, e := range edges {
			if errs[i] != nil {
				t.Errorf("round %d: edge %d: %v", round, i, errs[i])
				continue
			}
			seen[e.Addr("http").String()] = true
		}
		for i, e := range edges {
			if e != nil {
				if err := trustedBy(e.CAFile(), e.Addr("https").String()); err != nil {
					t.Errorf("round %d: edge %d: %v", round, i, err)
				}
			}
		}
		for _, e := range edges {
			if e != nil {
				e.Close()
			}
		}
		if t.Failed() {
			return
		}
		if len(seen) != n || !seen[embeddedAddrs["http"]] {
			t.Fatalf("round %d: HTTP addresses %v, want %d distinct with %s among them", round, seen, n, embeddedAddrs["http"])
		}
	}
}

// trustedBy handshakes with addr trusting only the CA in caFile.
func trustedBy(caFile, addr string) error {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", addr, &tls.Config{RootCAs: roots, ServerName: "app.localhost"})
	if err != nil {
		return err
	}
	return c.Close()
}

// freeLoopback is a loopback address with a port free a moment ago.
func freeLoopback(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
