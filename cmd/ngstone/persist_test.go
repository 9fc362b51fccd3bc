package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/mux"
)

// A single edge keeps its registry in --data-dir: the tests here kill and
// restart a real edge process and check what each visitor and agent meets.

// tunnels reads an edge's admin /api/tunnels.
func tunnels(t *testing.T, admin string) []map[string]any {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/api/tunnels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out []map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestEdgeRestartKeepsOwners: three agents are bound; the edge is killed
// (SIGKILL) and started again. Until each agent is back, its visitors get
// 503 tunnel_offline with Retry-After, never 404; each agent is back on its
// own name at a higher generation. Then, with one agent gone for good,
// another instance asking for its name is refused, saying when the name
// frees itself, and gets it once the holder's window has passed.
func TestEdgeRestartKeepsOwners(t *testing.T) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	data := t.TempDir()
	ports := freePorts(t, 3)
	visitors, admin := "127.0.0.1:"+ports[0], "127.0.0.1:"+ports[2]
	args := edgeArgs(data, ports, "--heartbeat-timeout", "3s")
	e := startProc(t, nil, args...)
	waitHealthy(t, admin)
	names := []string{"one", "two", "three"}
	agents := map[string]*proc{}
	for _, n := range names {
		agents[n] = startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
			"--subdomain", n, "--heartbeat-interval", "300ms", "--heartbeat-timeout", "2s", "--log-format", "json")
		agents[n].waitLine(t, forwardingAny)
	}
	before := map[string]float64{}
	for _, tn := range tunnels(t, admin) {
		before[tn["hostname"].(string)] = tn["generation"].(float64)
	}

	e.cmd.Process.Kill()
	<-e.exited
	e = startProc(t, nil, args...)
	waitHealthy(t, admin)
	ready := time.Now()
	c := visitorClient(t, visitors)
	var back []time.Duration
	for _, n := range names {
		host := n + ".ngstone.test"
		for {
			resp, err := c.Get("http://" + host + "/")
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				back = append(back, time.Since(ready))
				break
			}
			if resp.StatusCode != 503 || resp.Header.Get(mux.ErrorHeader) != mux.CodeTunnelOffline || resp.Header.Get("Retry-After") == "" {
				t.Fatalf("%s after the restart: %d %s, want 503 tunnel_offline with Retry-After until its agent is back", host, resp.StatusCode, resp.Header.Get(mux.ErrorHeader))
			}
			if time.Since(ready) > 20*time.Second {
				t.Fatalf("%s: its agent never came back", host)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	slices.Sort(back)
	t.Logf("from the new edge's readiness to each name's first 200: %v (median %s)", back, back[1].Round(time.Millisecond))
	for _, tn := range tunnels(t, admin) {
		h := tn["hostname"].(string)
		if g := tn["generation"].(float64); g <= before[h] {
			t.Errorf("%s at generation %v after the restart, %v before", h, g, before[h])
		}
	}

	// The agent of "one" goes for good, and the edge restarts again.
	agents["one"].cmd.Process.Kill()
	<-agents["one"].exited
	e.cmd.Process.Kill()
	<-e.exited
	startProc(t, nil, args...)
	waitHealthy(t, admin)
	other := []string{"http", port, "--edge", "127.0.0.1:" + ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "one"}
	// Another machine: another cache, so another instance.
	env := []string{"XDG_CACHE_HOME=" + t.TempDir()}
	refused := startProc(t, env, other...)
	if code := refused.exitCode(t); code != exitRefused {
		t.Fatalf("another instance within the window: exit %d, want %d", code, exitRefused)
	}
	if s := refused.stderrText(); !strings.Contains(s, "subdomain_taken") || !strings.Contains(s, "frees itself in") {
		t.Fatalf("the refusal does not say when the name frees itself:\n%s", s)
	}
	var taker *proc
	waitFor(t, 20*time.Second, "another instance to get the name once the window passed", func() bool {
		if taker != nil {
			select {
			case <-taker.exited:
			default:
				return true
			}
		}
		taker = startProc(t, env, other...)
		select {
		case l := <-taker.lines:
			return strings.HasPrefix(l, "Forwarding")
		case <-taker.exited:
			return false
		case <-time.After(5 * time.Second):
			return false
		}
	})
}

// rawEdgeAgent is a hand-driven agent of one instance against an edge
// process: it binds and unbinds names, recording what the edge
// acknowledged.
type rawEdgeAgent struct {
	control string
	roots   *x509.CertPool
	id      string
}

// acked is the last operation on a name the edge acknowledged; pending,
// one it was sent but did not acknowledge before it was killed (which may
// or may not have happened).
type acked struct {
	bound   bool
	gen     uint64
	pending bool // a release of gen was sent
}

// cycle connects, then binds and unbinds names until the connection
// breaks; every bind_ok and unbound is recorded in last (by name) and
// the highest generation in top.
func (a *rawEdgeAgent) cycle(last map[string]acked, top *uint64) {
	c, err := tls.Dial("tcp", a.control, &tls.Config{RootCAs: a.roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
	if err != nil {
		return
	}
	ys, err := yamux.Client(c, nil)
	if err != nil {
		c.Close()
		return
	}
	defer ys.Close()
	ctrl, err := ys.OpenStream()
	if err != nil {
		return
	}
	ctrl.SetDeadline(time.Now().Add(5 * time.Second))
	if mux.Write(ctrl, &mux.Hello{Version: mux.Version, InstanceID: a.id}) != nil {
		return
	}
	if m, err := mux.Read(ctrl); err != nil || m.MessageType() != mux.TypeHelloOK {
		return
	}
	for i := 0; ; i++ {
		name := fmt.Sprintf("n%d", i%4)
		if mux.Write(ctrl, &mux.Bind{Subdomain: name, Takeover: true}) != nil {
			return
		}
		m, err := mux.Read(ctrl)
		if err != nil {
			return
		}
		ok, isOK := m.(*mux.BindOK)
		if !isOK {
			return
		}
		last[ok.Hostname] = acked{bound: true, gen: ok.Generation}
		*top = max(*top, ok.Generation)
		if i%3 == 0 {
			continue // keep some names bound across the kill
		}
		last[ok.Hostname] = acked{bound: true, gen: ok.Generation, pending: true}
		if mux.Write(ctrl, &mux.Unbind{Hostname: ok.Hostname}) != nil {
			return
		}
		if m, err := mux.Read(ctrl); err != nil || m.MessageType() != mux.TypeUnbound {
			return
		}
		last[ok.Hostname] = acked{bound: false, gen: ok.Generation}
	}
}

// TestEdgeKilledMidBind: the edge is killed with SIGKILL at a random
// moment, 100 times, while an agent binds and releases names in a loop.
// After each restart the registry opens; every bind the edge acknowledged
// is there (or a later one), every acknowledged release is not undone, and
// every new generation is higher than any acknowledged before.
func TestEdgeKilledMidBind(t *testing.T) {
	if testing.Short() {
		t.Skip("100 restarts")
	}
	data := t.TempDir()
	ports := freePorts(t, 3)
	admin := "127.0.0.1:" + ports[2]
	args := edgeArgs(data, ports, "--heartbeat-timeout", "1m")
	e := startProc(t, nil, args...)
	waitHealthy(t, admin)
	roots := dataDirCA(t, data)
	a := &rawEdgeAgent{control: "127.0.0.1:" + ports[1], roots: roots, id: agent.NewInstanceID()}
	last := map[string]acked{}
	var top uint64
	for cycle := range 100 {
		done := make(chan struct{})
		go func() { defer close(done); a.cycle(last, &top) }()
		time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
		e.cmd.Process.Signal(syscall.SIGKILL)
		<-e.exited
		<-done
		e = startProc(t, nil, args...)
		waitHealthy(t, admin)
		listed := map[string]uint64{}
		for _, tn := range tunnels(t, admin) {
			h := tn["hostname"].(string)
			if _, dup := listed[h]; dup {
				t.Fatalf("cycle %d: %s listed twice", cycle, h)
			}
			listed[h] = uint64(tn["generation"].(float64))
		}
		for h, ack := range last {
			g, ok := listed[h]
			switch {
			case ack.bound && !ack.pending && (!ok || g < ack.gen), ack.bound && ok && g < ack.gen:
				t.Fatalf("cycle %d: %s was acknowledged bound at generation %d, and after the restart is %v (%d)", cycle, h, ack.gen, ok, g)
			case !ack.bound && ok && g <= ack.gen:
				t.Fatalf("cycle %d: %s was acknowledged released at generation %d, and after the restart is bound at %d", cycle, h, ack.gen, g)
			}
			if ack.pending && !ok {
				last[h] = acked{gen: ack.gen} // the release happened
			}
		}
		if g := a.bindOnce(t); g <= top {
			t.Fatalf("cycle %d: a bind after the restart got generation %d, not above %d", cycle, g, top)
		} else {
			top = g
		}
	}
	t.Logf("100 kills; highest generation acknowledged %d", top)
}

// bindOnce binds one name and returns its generation.
func (a *rawEdgeAgent) bindOnce(t *testing.T) uint64 {
	t.Helper()
	c, err := tls.Dial("tcp", a.control, &tls.Config{RootCAs: a.roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
	if err != nil {
		t.Fatal(err)
	}
	ys, _ := yamux.Client(c, nil)
	defer ys.Close()
	ctrl, _ := ys.OpenStream()
	ctrl.SetDeadline(time.Now().Add(5 * time.Second))
	mux.Write(ctrl, &mux.Hello{Version: mux.Version, InstanceID: a.id})
	mux.Read(ctrl)
	mux.Write(ctrl, &mux.Bind{Subdomain: "probe", Takeover: true})
	m, err := mux.Read(ctrl)
	ok, isOK := m.(*mux.BindOK)
	if err != nil || !isOK {
		t.Fatalf("bind after a restart: %v %v", m, err)
	}
	return ok.Generation
}

// TestEdgeRefusesForeignRegistry: a registry file that is damaged or not
// ngstone's stops the edge with an error naming it, and stays as it was.
func TestEdgeRefusesForeignRegistry(t *testing.T) {
	data := t.TempDir()
	path := filepath.Join(data, "registry.db")
	junk := bytes.Repeat([]byte("not a registry "), 2000)
	if err := os.WriteFile(path, junk, 0o600); err != nil {
		t.Fatal(err)
	}
	ports := freePorts(t, 3)
	p := startProc(t, nil, edgeArgs(data, ports)...)
	if code := p.exitCode(t); code != exitError {
		t.Fatalf("edge on a foreign registry exited %d, want %d", code, exitError)
	}
	if s := p.stderrText(); !strings.Contains(s, path) {
		t.Fatalf("the error does not name %s:\n%s", path, s)
	}
	if after, _ := os.ReadFile(path); !bytes.Equal(after, junk) {
		t.Fatal("the foreign file was changed")
	}
}

// TestEdgeSIGTERMUnderBurst: SIGTERM lands in a burst of visitors on new
// connections, 20 times: no visitor gets a 502; each gets the local
// service's answer or a coded 503 with Retry-After, or (for a connection
// the edge had stopped listening for) a refused one. A request the edge
// accepted, or the kernel queued for it, is answered: net/http would drop
// one it read once shutting down, and closing the socket would reset the
// queued ones. About 30 s.
func TestEdgeSIGTERMUnderBurst(t *testing.T) {
	if testing.Short() {
		t.Skip("20 shutdowns")
	}
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	data := t.TempDir()
	ports := freePorts(t, 4)
	visitors, admin, secure := "127.0.0.1:"+ports[0], "127.0.0.1:"+ports[2], "127.0.0.1:"+ports[3]
	args := edgeArgs(data, ports, "--shutdown-grace", "5s", "--https-addr", secure)
	counts := map[string]int{}
	var visitorTLS *tls.Config // every other visitor comes over HTTPS
	for cycle := range 20 {
		e := startProc(t, nil, args...)
		waitHealthy(t, admin)
		if cycle == 0 {
			startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
				"--subdomain", "burst", "--dial-timeout", "1s", "--log-format", "json")
			pem, err := os.ReadFile(filepath.Join(data, "ca.pem"))
			if err != nil {
				t.Fatal(err)
			}
			roots := x509.NewCertPool()
			roots.AppendCertsFromPEM(pem)
			visitorTLS = &tls.Config{RootCAs: roots, ServerName: "burst.ngstone.test", NextProtos: []string{"http/1.1"}}
		}
		waitFor(t, 20*time.Second, "the agent bound", func() bool {
			resp, err := http.Get("http://" + admin + "/api/tunnels/burst.ngstone.test")
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			var tn map[string]any
			json.NewDecoder(resp.Body).Decode(&tn)
			return tn["online"] == true
		})
		var wg sync.WaitGroup
		var mu sync.Mutex
		for i := range 30 {
			wg.Go(func() {
				scheme, r := "http", ""
				if i%2 == 0 {
					r = burstGet(visitors, nil)
				} else {
					scheme, r = "https", burstGet(secure, visitorTLS)
				}
				mu.Lock()
				counts[scheme+": "+r]++
				mu.Unlock()
			})
			if i == 10 {
				e.cmd.Process.Signal(syscall.SIGTERM)
			}
		}
		wg.Wait()
		if code := e.exitCode(t); code != 0 {
			t.Fatalf("cycle %d: the edge exited %d", cycle, code)
		}
	}
	t.Logf("600 visitors across 20 SIGTERMs: %v", counts)
	for r, n := range counts {
		switch _, what, _ := strings.Cut(r, ": "); what {
		case "200", "503 tunnel_offline", "connection refused or reset":
		default:
			// A reset after the request: a visitor whose handshake was
			// under way at the stop, connected in its own eyes, was cut
			// (23 of 600 in a CI run before the listener was plain TCP
			// and let those handshakes complete). An EOF: the edge read
			// a request and dropped it.
			t.Errorf("%d visitors got %s", n, r)
		}
	}
}

// burstGet sends one GET on a new connection, over TLS with tc, and says
// what came back: refused (the connection was not accepted: the edge had
// stopped listening; over TLS, also a handshake the edge never began),
// dropped (the edge accepted the connection and the request went out, but
// no answer came: an EOF or a reset), or the answer.
func burstGet(addr string, tc *tls.Config) string {
	raw, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		return "connection refused or reset"
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	c := raw
	if tc != nil {
		tlsc := tls.Client(raw, tc)
		if err := tlsc.Handshake(); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
				return "TLS handshake cut" // an accepted connection dropped
			}
			return "TLS handshake: " + err.Error()
		}
		c = tlsc
	}
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: burst.ngstone.test\r\nConnection: close\r\n\r\n"); err != nil {
		return "connection refused or reset" // reset before the request left
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return "dropped: EOF after the request"
	case errors.Is(err, syscall.ECONNRESET):
		return "dropped: reset after the request"
	case err != nil:
		return "dropped: " + err.Error()
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if code := resp.Header.Get(mux.ErrorHeader); code != "" {
		if resp.StatusCode == 503 && resp.Header.Get("Retry-After") == "" {
			return "503 without Retry-After"
		}
		return fmt.Sprintf("%d %s", resp.StatusCode, code)
	}
	return fmt.Sprint(resp.StatusCode)
}

// TestEdgeSIGTERMBlackholedAgent: one agent's path goes silent with a
// request of its in flight; the edge, sent SIGTERM, exits within 2 s of its
// shutdown grace, and another tunnel's request in flight is answered.
func TestEdgeSIGTERMBlackholedAgent(t *testing.T) {
	entered := make(chan string, 2)
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		entered <- r.Host
		if strings.HasPrefix(r.Host, "silent.") {
			<-r.Context().Done() // never answers while the path is up
			return
		}
		time.Sleep(500 * time.Millisecond)
		io.WriteString(w, "served")
	})
	data := t.TempDir()
	ports := freePorts(t, 3)
	visitors, admin := "127.0.0.1:"+ports[0], "127.0.0.1:"+ports[2]
	const grace = 2 * time.Second
	e := startProc(t, nil, edgeArgs(data, ports, "--shutdown-grace", grace.String())...)
	waitHealthy(t, admin)
	p := startSilentProxy(t, "127.0.0.1:"+ports[1])
	agentArgs := func(name, edgeAddr string) []string {
		return []string{"http", port, "--edge", edgeAddr, "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", name,
			"--server-name", "localhost", "--log-format", "json"}
	}
	startProc(t, nil, agentArgs("silent", p.addr)...).waitLine(t, forwardingAny)
	startProc(t, nil, agentArgs("fine", "127.0.0.1:"+ports[1])...).waitLine(t, forwardingAny)
	c := visitorClient(t, visitors)
	go get(c, "http://silent.ngstone.test/")
	<-entered
	p.hush()
	fine := make(chan string, 1)
	go func() {
		code, body, err := get(c, "http://fine.ngstone.test/")
		fine <- fmt.Sprint(code, " ", body, " ", err)
	}()
	<-entered
	start := time.Now()
	e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.exited:
	case <-time.After(grace + 10*time.Second):
		t.Fatal("the edge did not exit")
	}
	took := time.Since(start)
	t.Logf("the edge exited %s after SIGTERM (grace %s)", took.Round(time.Millisecond), grace)
	if took > grace+2*time.Second {
		t.Errorf("the edge took %s to exit, over its %s grace and 2 s", took, grace)
	}
	if got := <-fine; got != "200 served <nil>" {
		t.Errorf("the other tunnel's request in flight: %s", got)
	}
}
