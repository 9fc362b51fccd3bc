package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// proc is a running ngstone process with its output lines.
type proc struct {
	cmd    *exec.Cmd
	lines  chan string
	mu     sync.Mutex
	stderr strings.Builder
	exited chan struct{}
	err    error
}

func startProc(t *testing.T, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(ngstoneBin, args...)
	cmd.Env = append(os.Environ(), env...)
	return runProc(t, cmd)
}

// runProc starts cmd and collects its output until the test ends.
func runProc(t *testing.T, cmd *exec.Cmd) *proc {
	t.Helper()
	args := cmd.Args[1:]
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, lines: make(chan string, 100), exited: make(chan struct{})}
	cmd.Stderr = &lockedWriter{p: p}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-p.exited
		if t.Failed() {
			t.Logf("%s stderr:\n%s", strings.Join(args, " "), p.stderrText())
		}
	})
	return p
}

type lockedWriter struct{ p *proc }

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.p.mu.Lock()
	defer w.p.mu.Unlock()
	return w.p.stderr.Write(b)
}

func (p *proc) stderrText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderr.String()
}

// waitLine returns the first stdout line matching re.
func (p *proc) waitLine(t *testing.T, re *regexp.Regexp) []string {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case l, ok := <-p.lines:
			if !ok {
				t.Fatalf("process exited before printing %s", re)
			}
			if m := re.FindStringSubmatch(l); m != nil {
				return m
			}
		case <-deadline:
			t.Fatalf("no line matching %s", re)
		}
	}
}

// exitCode waits for the process to exit and returns its code.
func (p *proc) exitCode(t *testing.T) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(20 * time.Second):
		t.Fatal("process did not exit")
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		return ee.ExitCode()
	}
	if p.err != nil {
		t.Fatal(p.err)
	}
	return 0
}

// localhostClient resolves every host to 127.0.0.1, as curl and browsers
// do for *.localhost, and trusts the CA in caFile.
func localhostClient(t *testing.T, caFile string) *http.Client {
	t.Helper()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	d := &net.Dialer{Timeout: 5 * time.Second}
	return &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots},
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			_, port, _ := net.SplitHostPort(addr)
			return d.DialContext(ctx, network, net.JoinHostPort("127.0.0.1", port))
		},
	}}
}

func backend(t *testing.T, h http.HandlerFunc) (*httptest.Server, string) {
	s := httptest.NewServer(h)
	t.Cleanup(s.Close)
	_, port, _ := net.SplitHostPort(s.Listener.Addr().String())
	return s, port
}

var forwarding = regexp.MustCompile(`^Forwarding (https?)://([a-z0-9-]+)\.localhost:(\d+) -> (\S+)$`)

// TestEmbeddedDefault: `ngstone http PORT` alone serves PORT at a printed
// *.localhost URL, over HTTPS (trusting the CA it names) and HTTP; Ctrl-C
// exits 0.
func TestEmbeddedDefault(t *testing.T) {
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	entered := make(chan struct{}, 1)
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-release
		}
		io.WriteString(w, "hello from "+r.Host)
	})
	// Registered after the backend, so it runs before the backend's Close,
	// which waits for the /slow handler: a failed test must not hang.
	t.Cleanup(unblock)
	cache := t.TempDir()
	p := startProc(t, []string{"XDG_CACHE_HOME=" + cache, "HOME=" + cache}, "http", port)
	m := p.waitLine(t, forwarding)
	if m[1] != "https" || m[4] != "http://localhost:"+port {
		t.Fatalf("first Forwarding line %q", m[0])
	}
	name, httpsPort := m[2], m[3]
	m2 := p.waitLine(t, forwarding)
	if m2[1] != "http" || m2[2] != name {
		t.Fatalf("second Forwarding line %q", m2[0])
	}
	c := localhostClient(t, filepath.Join(cache, "ngstone", "ca.pem"))
	for _, u := range []string{"https://" + name + ".localhost:" + httpsPort + "/", "http://" + name + ".localhost:" + m2[3] + "/"} {
		resp, err := c.Get(u)
		if err != nil {
			t.Fatalf("GET %s: %v", u, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.HasPrefix(string(body), "hello from "+name+".localhost") {
			t.Fatalf("GET %s: %d %q", u, resp.StatusCode, body)
		}
	}

	// Ctrl-C with a request in flight: it completes, then the agent exits 0.
	done := make(chan error, 1)
	var code int
	go func() {
		resp, err := c.Get("https://" + name + ".localhost:" + httpsPort + "/slow")
		if err == nil {
			code = resp.StatusCode
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	<-entered
	p.cmd.Process.Signal(syscall.SIGINT)
	// The unbind happens while the request is in flight: the edge stops
	// routing the name (a new request is told tunnel_not_found) before the
	// request may finish.
	deadline := time.Now().Add(20 * time.Second)
	for !unbound(c, "https://"+name+".localhost:"+httpsPort+"/") {
		if time.Now().After(deadline) {
			t.Fatalf("the edge still routes %s 20s after Ctrl-C; stderr:\n%s", name, p.stderrText())
		}
		time.Sleep(5 * time.Millisecond)
	}
	unblock()
	if err := <-done; err != nil || code != 200 {
		t.Fatalf("in-flight request across Ctrl-C: %d %v", code, err)
	}
	if c := p.exitCode(t); c != 0 {
		t.Fatalf("exit code %d after Ctrl-C", c)
	}
}

// unbound reports whether the edge answers u with tunnel_not_found: the
// agent has unbound its name.
func unbound(c *http.Client, u string) bool {
	resp, err := c.Get(u)
	if err != nil {
		return false
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusNotFound && resp.Header.Get("Ngstone-Error") == "tunnel_not_found"
}

// TestEdgeAndAgentProcesses: the two-terminal flow of the README, and the
// exit code of an agent refused a name.
func TestEdgeAndAgentProcesses(t *testing.T) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "two terminals") })
	data := t.TempDir()
	ports := startLocalhostEdge(t, data)
	agentArgs := []string{"http", port, "--edge", "localhost:" + ports[2], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", "demo"}
	a := startProc(t, nil, agentArgs...)
	m := a.waitLine(t, forwarding)
	if m[2] != "demo" || m[3] != ports[1] {
		t.Fatalf("Forwarding line %q", m[0])
	}
	c := localhostClient(t, filepath.Join(data, "ca.pem"))
	resp, err := c.Get("https://demo.localhost:" + ports[1] + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "two terminals" {
		t.Fatalf("body %q", body)
	}

	other := startProc(t, nil, agentArgs...)
	if code := other.exitCode(t); code != exitRefused {
		t.Fatalf("second agent for the same name exited %d, want %d", code, exitRefused)
	}
	if s := other.stderrText(); !strings.Contains(s, "subdomain_taken") {
		t.Fatalf("refusal not explained on stderr:\n%s", s)
	}

	bad := startProc(t, nil, "edge", "--domain", "localhost", "--drain-timeout", "soon")
	if code := bad.exitCode(t); code != exitUsage || !strings.Contains(bad.stderrText(), "drain-timeout") {
		t.Fatalf("bad flag: exit %d, stderr %q", code, bad.stderrText())
	}
}

func freePorts(t *testing.T, n int) []string {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	var out []string
	var lns []net.Listener
	for try := 0; len(out) < n; try++ {
		if try == 10000 {
			t.Fatalf("no %d free loopback ports below the ephemeral range", n)
		}
		p := portsFrom + rand.IntN(portsTo-portsFrom)
		if handedOut[p] {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		handedOut[p] = true
		lns = append(lns, ln)
		out = append(out, strconv.Itoa(p))
	}
	for _, ln := range lns {
		ln.Close()
	}
	return out
}

// freePorts hands out ports below the kernel's ephemeral range (32768 and
// up by default), so that no test's outgoing connection takes one as its
// source port between the check and the process that listens on it, and
// never the same one twice in this process.
const portsFrom, portsTo = 20000, 32000

var (
	portsMu   sync.Mutex
	handedOut = map[int]bool{}
)

func waitHealthy(t *testing.T, admin string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for healthcheck(context.Background(), admin, time.Second) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("edge at %s never became healthy", admin)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// dataDirCA is the pool of the self-signed CA an edge wrote to data.
func dataDirCA(t *testing.T, data string) *x509.CertPool {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(data, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	return roots
}

// startLocalhostEdge runs `ngstone edge --domain localhost` on data and four
// free loopback ports (HTTP, HTTPS, control, admin), which it returns once
// the edge is healthy.
func startLocalhostEdge(t *testing.T, data string) []string {
	t.Helper()
	ports := freePorts(t, 4)
	startProc(t, nil, "edge", "--domain", "localhost", "--data-dir", data,
		"--http-addr", "127.0.0.1:"+ports[0], "--https-addr", "127.0.0.1:"+ports[1],
		"--control-addr", "127.0.0.1:"+ports[2], "--admin-addr", "127.0.0.1:"+ports[3])
	waitHealthy(t, "127.0.0.1:"+ports[3])
	return ports
}
