package main

import (
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/conntest"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestRestartedAgentTakesItsNameBack: an agent loses its network and is
// killed; the edge still holds its connection, silent but open, as after a
// Wi-Fi drop. The agent started again on the same machine is the same
// instance and gets the name back at once, instead of waiting out the
// edge's heartbeat timeout. A second agent started while that one runs is
// another instance, and is refused.
func TestRestartedAgentTakesItsNameBack(t *testing.T) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "back") })
	data := t.TempDir()
	ports := freePorts(t, 4)
	startProc(t, nil, "edge", "--domain", "localhost", "--data-dir", data,
		"--http-addr", "127.0.0.1:"+ports[0], "--https-addr", "127.0.0.1:"+ports[1],
		"--control-addr", "127.0.0.1:"+ports[2], "--admin-addr", "127.0.0.1:"+ports[3],
		"--heartbeat-timeout", "60s") // the lost agent looks alive for the whole test
	waitHealthy(t, "127.0.0.1:"+ports[3])
	network := startSilentProxy(t, "127.0.0.1:"+ports[2])
	env := []string{"XDG_CACHE_HOME=" + t.TempDir()} // this machine's cache
	args := []string{"http", port, "--edge", network.addr, "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "keep"}

	lost := startProc(t, env, args...)
	lost.waitLine(t, forwarding)
	network.hush() // its connection goes silent, and stays open at the edge
	lost.cmd.Process.Kill()
	lost.exitCode(t)

	start := time.Now()
	restarted := startProc(t, env, args...)
	m := restarted.waitLine(t, forwarding)
	t.Logf("the restarted agent was back in %s", time.Since(start).Round(time.Millisecond))
	if m[2] != "keep" {
		t.Fatalf("the restarted agent got %q", m[0])
	}
	c := localhostClient(t, filepath.Join(data, "ca.pem"))
	tunneltest.Eventually(t, 10*time.Second, "the name to serve again", func() bool {
		resp, err := c.Get("https://keep.localhost:" + ports[1] + "/")
		if err != nil {
			return false
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return string(body) == "back"
	})

	second := startProc(t, env, args...)
	if code := second.exitCode(t); code != exitRefused || !strings.Contains(second.stderrText(), "subdomain_taken") {
		t.Fatalf("a second agent while the restarted one runs: exit %d, stderr:\n%s", code, second.stderrText())
	}
}

// silentProxy forwards agents' connections to the edge. hush makes the
// connections open now forward nothing more, in either direction, and keep
// the edge's side open whatever happens to the agent's: a network that
// dropped without either end being told. tunneltest.FaultProxy passes an
// agent's reset on, which would tell the edge.
type silentProxy struct {
	addr string

	mu    sync.Mutex
	links []*atomic.Bool // hushed, one per connection
}

func startSilentProxy(t *testing.T, target string) *silentProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &silentProxy{addr: ln.Addr().String()}
	pump := func(src, dst net.Conn, hushed *atomic.Bool) {
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 && !hushed.Load() {
				dst.Write(buf[:n])
			}
			if err != nil {
				return // never closes dst: the other end is not told
			}
		}
	}
	conntest.Serve(t, ln, func(a net.Conn) {
		b, err := net.Dial("tcp", target)
		if err != nil {
			return
		}
		hushed := new(atomic.Bool)
		p.mu.Lock()
		p.links = append(p.links, hushed)
		p.mu.Unlock()
		var wg sync.WaitGroup
		wg.Go(func() { pump(b, a, hushed) })
		pump(a, b, hushed)
		// Both ends stay open, whichever side went, until the test ends.
		<-t.Context().Done()
		b.Close()
		wg.Wait()
	})
	return p
}

func (p *silentProxy) hush() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range p.links {
		h.Store(true)
	}
}
