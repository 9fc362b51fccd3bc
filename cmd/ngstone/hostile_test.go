package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// The tests of this file attack a real edge process: a hostile agent, a
// crowd of visitors that never read, a control port under a low file
// limit, and a token sprayer. The edge's memory is read from /proc.

// forwardingAny is an agent's Forwarding line, for any domain.
var forwardingAny = regexp.MustCompile(`^Forwarding (https?)://(\S+) -> (\S+)$`)

// memKiB returns a process's resident set (VmRSS) and its peak (VmHWM).
func memKiB(t *testing.T, pid int) (rss, peak int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.Atoi(f[1])
		switch f[0] {
		case "VmRSS:":
			rss = n
		case "VmHWM:":
			peak = n
		}
	}
	return rss, peak
}

// rawAgent is a hand-driven agent on the upstream yamux module: it says
// hello, binds name and serves each stream with serve.
func rawAgent(t *testing.T, control, caFile, name string, serve func(net.Conn)) {
	t.Helper()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	r, m := tunneltest.DialRawAt(t, control, roots, &mux.Hello{Version: mux.Version, InstanceID: agent.NewInstanceID()}, nil)
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	if m := r.Bind(t, &mux.Bind{Subdomain: name}); m.MessageType() != mux.TypeBindOK {
		t.Fatalf("bind: %v", m)
	}
	go func() {
		for {
			st, err := r.YS.AcceptStream()
			if err != nil {
				return
			}
			go serve(st)
		}
	}()
}

// TestHostileAgentHugeResponseHead: an agent that answers with a 400 MiB
// response head gets its visitor a coded 502, and the edge reads no more
// of it than its limit: its memory grows by less than 50 MiB.
func TestHostileAgentHugeResponseHead(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 3)
	e := startProc(t, nil, edgeArgs(data, ports)...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	var sent atomic.Int64
	rawAgent(t, "127.0.0.1:"+ports[1], filepath.Join(data, "ca.pem"), "evil", func(st net.Conn) {
		defer st.Close()
		if _, err := http.ReadRequest(bufio.NewReader(st)); err != nil {
			return
		}
		chunk := []byte(strings.Repeat("a", 64<<10))
		if _, err := io.WriteString(st, "HTTP/1.1 200 OK\r\nX-Big: "); err != nil {
			return
		}
		for range 400 << 20 / len(chunk) {
			n, err := st.Write(chunk)
			sent.Add(int64(n))
			if err != nil {
				return
			}
		}
		io.WriteString(st, "\r\n\r\n")
	})
	before, _ := memKiB(t, e.cmd.Process.Pid)
	status, code := visit(t, "127.0.0.1:"+ports[0], "evil.ngstone.test")
	_, peak := memKiB(t, e.cmd.Process.Pid)
	t.Logf("edge RSS %d KiB before, peak %d KiB after; the agent got %d MiB of its head out", before, peak, sent.Load()>>20)
	if status != http.StatusBadGateway || code != mux.CodeBadResponse {
		t.Errorf("visitor got %d %q, want 502 %s", status, code, mux.CodeBadResponse)
	}
	if grown := (peak - before) >> 10; grown >= 50 {
		t.Errorf("the edge's memory grew by %d MiB reading a hostile head, want under 50", grown)
	}
}

// visit sends one GET for host to addr and returns the status and the
// Ngstone-Error code.
func visit(t *testing.T, addr, host string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		},
	}}
	defer c.CloseIdleConnections()
	resp, err := c.Get("http://" + host + "/")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get(mux.ErrorHeader)
}

// dialFrom dials addr from a loopback address of its own, as another
// visitor would.
func dialFrom(local string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}, Timeout: 10 * time.Second}
	return d.DialContext
}

// TestVisitorsThatNeverRead: 1,000 visitors ask for a 100 MB response and
// read none of it, over HTTP/1.1 (a connection each) and over HTTP/2 (ten
// connections of 100 streams). Another visitor of the same tunnel still
// gets its answer within 2 s, and the edge's memory stays within what its
// limits allow: each address holds at most max-requests-per-ip of the
// tunnel's streams, and each stream at most its window of buffered bytes.
func TestVisitorsThatNeverRead(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 visitors")
	}
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/small" {
			io.WriteString(w, "small")
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(100<<20))
		buf := make([]byte, 64<<10)
		for range 100 << 20 / len(buf) {
			if _, err := w.Write(buf); err != nil {
				return
			}
		}
	})
	data := t.TempDir()
	ports := freePorts(t, 4)
	const perIP = 64
	e := startProc(t, nil, "edge", "--domain", "ngstone.test", "--data-dir", data,
		"--http-addr", "127.0.0.1:"+ports[0], "--https-addr", "127.0.0.1:"+ports[3],
		"--control-addr", "127.0.0.1:"+ports[1], "--admin-addr", "127.0.0.1:"+ports[2],
		"--max-requests-per-ip", strconv.Itoa(perIP), "--log-format", "json")
	waitHealthy(t, "127.0.0.1:"+ports[2])
	a := startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "big")
	a.waitLine(t, forwardingAny)
	base, _ := memKiB(t, e.cmd.Process.Pid)

	// HTTP/1.1: a connection each, from 127.0.0.1.
	var conns []net.Conn
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range 1000 {
		c, err := net.Dial("tcp", "127.0.0.1:"+ports[0])
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		io.WriteString(c, "GET /big HTTP/1.1\r\nHost: big.ngstone.test\r\n\r\n")
	}
	// HTTP/2: ten connections of 100 streams, from 127.0.0.3.
	roots := dataDirCA(t, data)
	h2 := &http.Transport{
		DialContext:     dialFrom("127.0.0.3"),
		TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: "big.ngstone.test"},
		Protocols:       new(http.Protocols),
	}
	h2.Protocols.SetHTTP2(true)
	t.Cleanup(h2.CloseIdleConnections)
	var wg sync.WaitGroup
	var bodies sync.Mutex
	var open []io.Closer
	for range 1000 {
		wg.Go(func() {
			req, _ := http.NewRequest("GET", "https://big.ngstone.test:"+ports[3]+"/big", nil)
			resp, err := h2.RoundTrip(req)
			if err == nil {
				bodies.Lock()
				open = append(open, resp.Body) // never read
				bodies.Unlock()
			}
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, b := range open {
			b.Close()
		}
	})

	// Let the tunnel fill every buffer it will fill: the edge's memory
	// stops growing.
	settled(t, e.cmd.Process.Pid)
	start := time.Now()
	other := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return dialFrom("127.0.0.2")(ctx, "tcp", "127.0.0.1:"+ports[0])
	}}}
	resp, err := other.Get("http://big.ngstone.test/small")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	took := time.Since(start)
	rss, peak := memKiB(t, e.cmd.Process.Pid)
	// Two addresses hold at most perIP streams each; a stream buffers at
	// most its window (1 MiB) and a copy buffer (32 KiB), a connection a
	// few of its own (64 KiB, generously); on top of the edge at rest.
	bound := base + 2*perIP*(1<<10+32) + 1010*64
	t.Logf("another visitor's answer in %s; edge RSS %d KiB at rest, %d KiB now, peak %d KiB, bound %d KiB", took.Round(time.Millisecond), base, rss, peak, bound)
	if resp.StatusCode != 200 || string(body) != "small" || took > 2*time.Second {
		t.Errorf("another visitor: %d %q in %s, want 200 within 2s", resp.StatusCode, body, took)
	}
	if peak > bound {
		t.Errorf("edge peak RSS %d KiB, over the %d KiB its limits allow", peak, bound)
	}
}

// settled waits until a process's resident set has not grown for half a
// second (at most 20 s).
func settled(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	last, since := 0, time.Now()
	for time.Since(since) < 500*time.Millisecond && time.Now().Before(deadline) {
		if rss, _ := memKiB(t, pid); rss > last+1024 {
			last, since = rss, time.Now()
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestControlPortUnderLowFileLimit: 250 connections to the control port of
// an edge limited to 100 open files make its accepts fail (too many open
// files); once they are gone, a new agent binds within 2 s.
func TestControlPortUnderLowFileLimit(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 3)
	cmd := exec.Command("sh", append([]string{"-c", `ulimit -n 100 && exec "$0" "$@"`, ngstoneBin}, edgeArgs(data, ports)...)...)
	e := runProc(t, cmd)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	var conns []net.Conn
	for range 250 {
		c, err := net.Dial("tcp", "127.0.0.1:"+ports[1])
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	waitFor(t, 10*time.Second, "the edge to hit its file limit", func() bool {
		return strings.Contains(e.stderrText(), "too many open files")
	})
	for _, c := range conns {
		c.Close()
	}
	start := time.Now()
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	a := startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "after")
	a.waitLine(t, forwardingAny)
	took := time.Since(start)
	t.Logf("a new agent bound %s after the 250 connections were released", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("bound after %s, want within 2s", took)
	}
	if status, _ := visit(t, "127.0.0.1:"+ports[0], "after.ngstone.test"); status != 200 {
		t.Errorf("visitor after: %d", status)
	}
}

// TestBannedAddressToldWhy: after five failed hellos from an address, a
// valid agent from it is told that its address is refused and when it may
// try again, waits that long instead of hammering the edge, and then binds.
func TestBannedAddressToldWhy(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 3)
	startProc(t, nil, edgeArgs(data, ports, "--token", "good", "--auth-failure-window", "3s")...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	args := func(token string) []string {
		return []string{"http", port, "--edge", "127.0.0.1:" + ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--authtoken", token, "--log-format", "json", "--log-level", "debug"}
	}
	for range 5 {
		if code := startProc(t, nil, args("bad")...).exitCode(t); code != exitRefused {
			t.Fatalf("bad token: exit %d, want %d", code, exitRefused)
		}
	}
	start := time.Now()
	good := startProc(t, nil, args("good")...)
	good.waitLine(t, forwardingAny)
	took := time.Since(start)
	logs := good.stderrText()
	t.Logf("the valid agent bound after %s", took.Round(time.Millisecond))
	if !strings.Contains(logs, "too many hellos") || !strings.Contains(logs, "refused until") {
		t.Errorf("the valid agent was not told why it was refused:\n%s", logs)
	}
	if n := strings.Count(logs, `"msg":"reconnect attempt"`); n > 3 {
		t.Errorf("the valid agent retried %d times while refused, want it to wait for the time it was given:\n%s", n, logs)
	}
}

// TestStrayBytesWarned: a local service that sends a body after HEAD gets
// the agent's warning (the connection is closed, and no visitor got the
// bytes), whichever check found them: on a machine that is not busy it is
// net/http's own, which prints the bytes (another visitor's, in general),
// and neither they nor net/http's line may reach the log.
func TestStrayBytesWarned(t *testing.T) {
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nstray-secret")
		}
	})
	_, port, _ := net.SplitHostPort(local)
	data := t.TempDir()
	ports := freePorts(t, 3)
	startProc(t, nil, edgeArgs(data, ports)...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	a := startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "stray", "--log-format", "json")
	a.waitLine(t, forwardingAny)
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "tcp", "127.0.0.1:"+ports[0])
	}}}
	defer c.CloseIdleConnections()
	resp, err := c.Head("http://stray.ngstone.test/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("HEAD: %d %s", resp.StatusCode, resp.Header.Get(mux.ErrorHeader))
	}
	waitFor(t, 10*time.Second, "the agent's warning of the stray bytes", func() bool {
		return strings.Contains(a.stderrText(), "sent bytes nobody asked for")
	})
	if logs := a.stderrText(); strings.Contains(logs, "stray-secret") || strings.Contains(logs, "Unsolicited") {
		t.Errorf("the stray bytes, or net/http's line quoting them, reached the agent's log:\n%s", logs)
	}
}
