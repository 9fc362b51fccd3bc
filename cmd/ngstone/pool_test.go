package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestPoolProcesses: three agents behind one name as users run them (two
// `ngstone http --pool`, one `ngstone start` with `pool: true` in its
// tunnels file) against `ngstone edge`: visitors spread evenly, a stopped
// local service fails no GET and rejoins when back, the admin API lists
// the members, and an agent without --pool is refused.
func TestPoolProcesses(t *testing.T) {
	data := t.TempDir()
	ports := startLocalhostEdge(t, data)
	ca := filepath.Join(data, "ca.pem")
	edgeArgs := []string{"--edge", "localhost:" + ports[2], "--ca-file", ca}

	var servers []*backendSwitch
	for i := range 3 {
		servers = append(servers, newBackendSwitch(t, fmt.Sprintf("b%d", i)))
	}
	for _, b := range servers[:2] {
		a := startProc(t, nil, append([]string{"http", b.port, "--subdomain", "team", "--pool"}, edgeArgs...)...)
		a.waitLine(t, forwarding)
	}
	cfg := filepath.Join(t.TempDir(), "ngstone.yml")
	file := fmt.Sprintf("edge: localhost:%s\nca-file: %s\npool-health-interval: 100ms\ntunnels:\n  team:\n    addr: %s\n    subdomain: team\n    pool: true\n", ports[2], ca, servers[2].port)
	if err := os.WriteFile(cfg, []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	startProc(t, nil, "start", "--all", "--config", cfg).waitLine(t, forwarding)

	c := localhostClient(t, ca)
	url := "https://team.localhost:" + ports[1] + "/"
	visit := func(n int) (map[string]int, []string) {
		var mu sync.Mutex
		counts, errs := map[string]int{}, []string(nil)
		var wg sync.WaitGroup
		for w := range 6 {
			wg.Go(func() {
				for i := w; i < n; i += 6 {
					resp, err := c.Get(url)
					mu.Lock()
					if err != nil {
						errs = append(errs, err.Error())
					} else {
						b, _ := io.ReadAll(resp.Body)
						resp.Body.Close()
						if resp.StatusCode == http.StatusOK {
							counts[string(b)]++
						} else {
							errs = append(errs, fmt.Sprintf("%d %s", resp.StatusCode, b))
						}
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		return counts, errs
	}
	counts, errs := visit(3000)
	if len(errs) > 0 {
		t.Fatalf("%d of 3000 failed, first %s", len(errs), errs[0])
	}
	for _, b := range servers {
		if n := counts[b.name]; n < 850 || n > 1150 {
			t.Errorf("%s served %d of 3000, want 1000 ± 15%%: %v", b.name, n, counts)
		}
	}

	servers[2].set(false)
	if counts, errs := visit(300); len(errs) > 0 || counts["b2"] > 0 {
		t.Fatalf("with b2 stopped: %v, errors %v", counts, errs)
	}
	servers[2].set(true)
	deadline := time.Now().Add(10 * time.Second)
	for counts, _ := visit(30); counts["b2"] == 0; counts, _ = visit(30) {
		if time.Now().After(deadline) {
			t.Fatal("b2 never rejoined the pool")
		}
	}

	resp, err := http.Get("http://127.0.0.1:" + ports[3] + "/api/tunnels/team.localhost")
	if err != nil {
		t.Fatal(err)
	}
	var tn struct {
		Pool    bool
		Members []struct {
			Online   bool
			Requests uint64
		}
	}
	err = json.NewDecoder(resp.Body).Decode(&tn)
	resp.Body.Close()
	if err != nil || !tn.Pool || len(tn.Members) != 3 {
		t.Fatalf("admin API: %+v (%v), want a pool of 3", tn, err)
	}

	solo := startProc(t, nil, append([]string{"http", servers[0].port, "--subdomain", "team"}, edgeArgs...)...)
	if code := solo.exitCode(t); code != exitRefused || !strings.Contains(solo.stderrText(), "pass --pool to join it") {
		t.Fatalf("agent without --pool: exit %d, stderr %s", code, solo.stderrText())
	}
}

// backendSwitch is a local service that answers its name, or, switched
// off, accepts no connection: its listener closes and opens again on the
// same port.
type backendSwitch struct {
	name, port string
	t          *testing.T
	mu         sync.Mutex
	srv        *http.Server
}

func newBackendSwitch(t *testing.T, name string) *backendSwitch {
	b := &backendSwitch{name: name, port: freePorts(t, 1)[0], t: t}
	b.set(true)
	t.Cleanup(func() { b.set(false) })
	return b
}

func (b *backendSwitch) set(on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !on {
		if b.srv != nil {
			b.srv.Close()
			b.srv = nil
		}
		return
	}
	srv := &http.Server{Addr: "127.0.0.1:" + b.port, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, b.name)
	})}
	ln, err := net.Listen("tcp", srv.Addr)
	if err != nil {
		b.t.Fatal(err)
	}
	go srv.Serve(ln)
	b.srv = srv
}
