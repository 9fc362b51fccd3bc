package main

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestConfigThenHTTP: `ngstone config` saves the token, the edge and its CA
// once; `ngstone http PORT` with no other flag then binds and serves.
func TestConfigThenHTTP(t *testing.T) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "saved once") })
	data := t.TempDir()
	ports := freePorts(t, 3)
	startProc(t, nil, edgeArgs(data, ports, "--token", "tok_s3cret")...)
	waitHealthy(t, "127.0.0.1:"+ports[2])

	env := []string{"XDG_CONFIG_HOME=" + t.TempDir()}
	for _, args := range [][]string{
		{"config", "add-authtoken", "tok_s3cret"},
		{"config", "set", "edge", "127.0.0.1:" + ports[1]},
		{"config", "set", "ca-file", filepath.Join(data, "ca.pem")},
		{"config", "check"},
	} {
		if code, out, errOut := runBin(t, nil, env, args...); code != 0 {
			t.Fatalf("ngstone %s: exit %d\n%s%s", strings.Join(args, " "), code, out, errOut)
		}
	}
	file := filepath.Join(strings.TrimPrefix(env[0], "XDG_CONFIG_HOME="), "ngstone", "ngstone.yml")
	if fi, err := os.Stat(file); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the settings file: %v, mode %v; want 0600", err, fi.Mode())
	}
	if code, _, errOut := runBin(t, nil, env, "config", "set", "edge"); code != exitUsage || !strings.Contains(errOut, "KEY VALUE") {
		t.Errorf("config set without a value: exit %d %q", code, errOut)
	}

	a := startProc(t, env, "http", port)
	m := a.waitLine(t, regexp.MustCompile(`^Forwarding http://([a-z0-9-]+)\.ngstone\.test:`+ports[0]+` -> `))
	code, body, err := get(visitorClient(t, "127.0.0.1:"+ports[0]), "http://"+m[1]+".ngstone.test/")
	if err != nil || code != 200 || body != "saved once" {
		t.Fatalf("through the tunnel: %d %q %v", code, body, err)
	}
}

// threeTunnelFile writes a settings file with three tunnels to three local
// services (each answering its own name) and returns it.
func threeTunnelFile(t *testing.T, control, ca string) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "edge: 127.0.0.1:%s\nca-file: %s\ntunnels:\n", control, ca)
	for _, name := range []string{"web", "shop", "docs"} {
		_, port := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, name) })
		fmt.Fprintf(&b, "  %s:\n    addr: %s\n    subdomain: %s\n", name, port, name)
	}
	file := filepath.Join(t.TempDir(), "ngstone.yml")
	if err := os.WriteFile(file, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return file
}

// serves reports whether name's URL reaches the service that answers want.
func serves(t *testing.T, edgeHTTP, name, want string) bool {
	code, body, err := get(visitorClient(t, edgeHTTP), "http://"+name+".ngstone.test/")
	return err == nil && code == 200 && body == want
}

// edgeBindings is the edge's admin view of the names: hostname -> binding.
func edgeBindings(t *testing.T, admin string) map[string]map[string]any {
	out := map[string]map[string]any{}
	for _, b := range tunnels(t, admin) {
		out[strings.TrimSuffix(b["hostname"].(string), ".ngstone.test")] = b
	}
	return out
}

var threeNames = []string{"web", "shop", "docs"}

// TestStartAll: `ngstone start --all` runs a file's three tunnels in one
// process: each URL its own service, the local API lists all three; after
// a partition of its path all three are back on one new session of the
// same instance, each a generation higher; another agent that takes one
// name over leaves the other two serving and the process running, and the
// log says which name went; Ctrl-C then exits 0, since two are left.
func TestStartAll(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 4)
	edgeHTTP, admin := "127.0.0.1:"+ports[0], "127.0.0.1:"+ports[2]
	startProc(t, nil, edgeArgs(data, ports[:3], "--heartbeat-timeout", "1s")...)
	waitHealthy(t, admin)
	network := tunneltest.StartFaultProxy(t, "127.0.0.1:"+ports[1])
	file := threeTunnelFile(t, ports[1], filepath.Join(data, "ca.pem"))
	inspect := "127.0.0.1:" + ports[3]
	a := startProc(t, []string{"XDG_CACHE_HOME=" + t.TempDir()}, "start", "--all", "--config", file,
		"--edge", network.Addr(), "--inspect-addr", inspect, "--log-format", "json",
		"--heartbeat-interval", "100ms", "--heartbeat-timeout", "30s", "--backoff-base", "50ms", "--backoff-cap", "500ms")
	tunneltest.Eventually(t, 20*time.Second, "the three names serving their own services", func() bool {
		for _, name := range threeNames {
			if !serves(t, edgeHTTP, name, name) {
				return false
			}
		}
		return true
	})
	listed := apiTunnels(t, inspect)
	for _, name := range threeNames {
		if !slices.Contains(listed, name+" http http://"+name+".ngstone.test:"+ports[0]) {
			t.Errorf("/api/tunnels lists %v, without %s", listed, name)
		}
	}
	before := edgeBindings(t, admin)
	session := before["web"]["session_id"]
	for _, name := range threeNames {
		if b := before[name]; b == nil || b["session_id"] != session || b["instance_id"] != before["web"]["instance_id"] {
			t.Fatalf("the edge's bindings: %v, want the three names on one session of one instance", before)
		}
	}

	// A partition: the path goes silent until the edge gives up on it.
	network.Block()
	tunneltest.Eventually(t, 10*time.Second, "the edge to see the agent gone", func() bool {
		return edgeBindings(t, admin)["web"]["online"] == false
	})
	returned := time.Now()
	network.Unblock()
	network.Reset() // the agent's old connection, as a NAT that forgot it
	tunneltest.Eventually(t, 20*time.Second, "the three names back on one new session", func() bool {
		now := edgeBindings(t, admin)
		for _, name := range threeNames {
			b := now[name]
			if b == nil || b["online"] != true || b["session_id"] == session || b["session_id"] != now["web"]["session_id"] ||
				b["instance_id"] != before[name]["instance_id"] || b["generation"].(float64) <= before[name]["generation"].(float64) {
				return false
			}
		}
		return true
	})
	t.Logf("all three back %s after the path returned", time.Since(returned).Round(time.Millisecond))
	for _, name := range threeNames {
		if !serves(t, edgeHTTP, name, name) {
			t.Errorf("%s after the partition: not its own service", name)
		}
	}

	// The agent stops answering; past the edge's heartbeat timeout another
	// agent takes "shop" over.
	a.cmd.Process.Signal(syscall.SIGSTOP)
	tunneltest.Eventually(t, 10*time.Second, "the edge to see the stopped agent gone", func() bool {
		return edgeBindings(t, admin)["shop"]["online"] == false
	})
	_, otherPort := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "other shop") })
	startProc(t, nil, "http", otherPort, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
		"--subdomain", "shop", "--inspect=false").waitLine(t, regexp.MustCompile(`^Forwarding http://shop\.ngstone\.test:`))
	a.cmd.Process.Signal(syscall.SIGCONT)
	tunneltest.Eventually(t, 20*time.Second, "web and docs serving again beside the other agent's shop", func() bool {
		return serves(t, edgeHTTP, "web", "web") && serves(t, edgeHTTP, "docs", "docs") && serves(t, edgeHTTP, "shop", "other shop")
	})
	tunneltest.Eventually(t, 10*time.Second, "the log to say which name went", func() bool {
		return regexp.MustCompile(`"msg":"tunnel taken over by another agent".*"tunnel":"shop"`).MatchString(a.stderrText())
	})
	select {
	case <-a.exited:
		t.Fatalf("the agent exited with two tunnels left: %v", a.err)
	default:
	}
	taker := edgeBindings(t, admin)["shop"]["instance_id"]
	if taker == before["shop"]["instance_id"] {
		t.Fatal("shop is still the first agent's")
	}
	// The line names the agent that took it, by what the admin API shows.
	if !regexp.MustCompile(`"msg":"tunnel taken over by another agent","[^\n]*by instance ` + fmt.Sprint(taker) + `\)"`).MatchString(a.stderrText()) {
		t.Errorf("the takeover's log line does not name %v:\n%s", taker, a.stderrText())
	}
	a.cmd.Process.Signal(os.Interrupt)
	if code := a.exitCode(t); code != exitOK {
		t.Fatalf("Ctrl-C with two tunnels left: exit %d, want 0", code)
	}
	after := edgeBindings(t, admin)
	if after["web"] != nil || after["docs"] != nil {
		t.Errorf("Ctrl-C left web or docs bound: %v", after)
	}
}

// TestStartAllRestarted: `ngstone start --all` killed (SIGKILL) while the
// edge still holds its silent connection, and started again: every name is
// back at once (the same instance, kept for the set of names), not after
// the edge's heartbeat timeout.
func TestStartAllRestarted(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 3)
	edgeHTTP := "127.0.0.1:" + ports[0]
	startProc(t, nil, edgeArgs(data, ports, "--heartbeat-timeout", "60s")...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	network := startSilentProxy(t, "127.0.0.1:"+ports[1])
	file := threeTunnelFile(t, ports[1], filepath.Join(data, "ca.pem"))
	env := []string{"XDG_CACHE_HOME=" + t.TempDir()}
	args := []string{"start", "--all", "--config", file, "--edge", network.addr, "--inspect=false"}
	online := func(p *proc) {
		t.Helper()
		seen := map[string]bool{}
		for len(seen) < 3 {
			m := p.waitLine(t, regexp.MustCompile(`^Forwarding http://([a-z]+)\.ngstone\.test:`))
			seen[m[1]] = true
		}
	}
	first := startProc(t, env, args...)
	online(first)
	network.hush()
	first.cmd.Process.Kill()
	first.exitCode(t)

	start := time.Now()
	restarted := startProc(t, env, args...)
	online(restarted)
	t.Logf("all three names back %s after the restart", time.Since(start).Round(time.Millisecond))
	for _, name := range threeNames {
		if !serves(t, edgeHTTP, name, name) {
			t.Errorf("%s after the restart: not its own service", name)
		}
	}
}

// TestStartBadEntries: a bad tunnel entry stops start-up (exit 2) with an
// error naming the tunnel and the key.
func TestStartBadEntries(t *testing.T) {
	for body, want := range map[string]string{
		"tunnels:\n  web:\n    addr: 3000\n    subdomian: x\n":                                 `tunnel "web": unknown key "subdomian"`,
		"tunnels:\n  web:\n    subdomain: x\n":                                                 `tunnel "web": addr: required`,
		"tunnels:\n  a:\n    addr: 1\n    subdomain: x\n  b:\n    addr: 2\n    subdomain: x\n": `tunnel "b": subdomain x is tunnel "a"'s too`,
	} {
		file := filepath.Join(t.TempDir(), "ngstone.yml")
		os.WriteFile(file, []byte(body), 0o600)
		code, _, errOut := runBin(t, nil, nil, "start", "--all", "--config", file)
		if code != exitUsage || !strings.Contains(errOut, want) {
			t.Errorf("%q: exit %d %q, want exit 2 and %q", body, code, errOut, want)
		}
	}
	if code, _, errOut := runBin(t, nil, nil, "start"); code != exitUsage || !strings.Contains(errOut, "--all") {
		t.Errorf("start with no name: exit %d %q", code, errOut)
	}
}

// TestStartConsole: `ngstone start --all` on a terminal (tmux, 120x40):
// a Forwarding line per tunnel, a Refused line for the one the edge will
// not give (a reserved name), each request line naming its tunnel, and,
// once another agent has taken one name over while this one was stopped,
// an Evicted line for it naming that agent, while the other goes on
// serving. About 3 s.
func TestStartConsole(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 3)
	admin := "127.0.0.1:" + ports[2]
	startProc(t, nil, edgeArgs(data, ports, "--reserved-names", "docs", "--heartbeat-timeout", "1s")...)
	waitHealthy(t, admin)
	file := threeTunnelFile(t, ports[1], filepath.Join(data, "ca.pem"))
	pane := startTmux(t, 120, 40, "start", "--all", "--config", file, "--inspect=false", "--console-refresh", "100ms",
		"--heartbeat-interval", "100ms", "--heartbeat-timeout", "30s", "--backoff-base", "50ms", "--backoff-cap", "500ms")
	screen := pane.waitScreen(t, "two tunnels online, one refused", func(s string) bool {
		return strings.Contains(s, "Forwarding                    shop: http://shop.ngstone.test:"+ports[0]+" -> ") &&
			strings.Contains(s, "Forwarding                    web: http://web.ngstone.test:"+ports[0]+" -> ") &&
			strings.Contains(s, "Refused                       docs: reserved_name")
	})
	pane.snapshot(t, tunneltest.ArtifactDir(t), "start-all", screen)
	if !serves(t, "127.0.0.1:"+ports[0], "shop", "shop") {
		t.Fatal("shop does not serve")
	}
	pane.waitScreen(t, "the request line naming its tunnel", func(s string) bool {
		return regexp.MustCompile(`\d\d:\d\d:\d\d\.\d{3}  GET     shop: / +200`).MatchString(s)
	})
	if dead, _ := pane.exit(t); dead {
		t.Fatal("the agent exited with two tunnels online")
	}

	// Stopped past the edge's heartbeat timeout, the agent loses web to
	// another agent; continued, it says so and serves shop again.
	pid := pane.pid(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	tunneltest.Eventually(t, 10*time.Second, "the edge to see the stopped agent gone", func() bool {
		return edgeBindings(t, admin)["web"]["online"] == false
	})
	_, otherPort := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "other web") })
	startProc(t, nil, "http", otherPort, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
		"--subdomain", "web", "--inspect=false").waitLine(t, regexp.MustCompile(`^Forwarding http://web\.ngstone\.test:`))
	syscall.Kill(pid, syscall.SIGCONT)
	screen = pane.waitScreen(t, "the Evicted line for web", func(s string) bool {
		return strings.Contains(s, "Evicted                       web: another agent (instance ") &&
			strings.Contains(s, "Session Status                online")
	})
	// It names the agent that took web, by what the admin API shows.
	if taker := edgeBindings(t, admin)["web"]["instance_id"]; !strings.Contains(screen, fmt.Sprintf("web: another agent (instance %v) took web.ngstone.test over", taker)) {
		t.Errorf("the Evicted line does not name %v:\n%s", taker, screen)
	}
	pane.snapshot(t, tunneltest.ArtifactDir(t), "start-all-evicted", screen)
	if strings.Contains(screen, "Forwarding                    web:") {
		t.Errorf("web still shown as forwarded after the takeover:\n%s", screen)
	}
	tunneltest.Eventually(t, 10*time.Second, "shop serving again beside the other agent's web", func() bool {
		return serves(t, "127.0.0.1:"+ports[0], "shop", "shop") && serves(t, "127.0.0.1:"+ports[0], "web", "other web")
	})
	if dead, code := pane.exit(t); dead {
		t.Fatalf("the agent exited (%d) with shop left", code)
	}
}

// TestStartAllTCPAndTLS: `ngstone start --all` with an HTTP, a TCP
// (`proto: tcp`, `remote_port:`) and a TLS passthrough (`proto: tls`)
// tunnel in the tunnels file: each serves its own local service through
// the edge, and the local API lists them as ngrok's agent does.
func TestStartAllTCPAndTLS(t *testing.T) {
	data := t.TempDir()
	ports := freePorts(t, 6)
	edgeHTTP, https, tcp, inspect := "127.0.0.1:"+ports[0], ports[3], ports[4], "127.0.0.1:"+ports[5]
	startProc(t, nil, edgeArgs(data, ports[:3], "--https-addr", "127.0.0.1:"+https, "--tcp-ports", tcp)...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	_, web := backend(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "web") })
	shell := tunneltest.ServeConns(t, func(c net.Conn) { io.WriteString(c, "shell\n") })
	cert, roots := tunneltest.SelfSigned(t, "secure.ngstone.test")
	secure := tunneltest.ServeConns(t, func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
		tc.SetDeadline(time.Now().Add(10 * time.Second))
		io.WriteString(tc, "secure\n")
	})
	file := filepath.Join(t.TempDir(), "ngstone.yml")
	write(t, file, fmt.Sprintf("edge: 127.0.0.1:%s\nca-file: %s\nserver-name: localhost\ntunnels:\n"+
		"  web:\n    addr: %s\n    subdomain: web\n"+
		"  shell:\n    proto: tcp\n    addr: %s\n    remote_port: %s\n"+
		"  secure:\n    proto: tls\n    addr: %s\n    subdomain: secure\n",
		ports[1], filepath.Join(data, "ca.pem"), web, shell, tcp, secure))
	startProc(t, []string{"XDG_CACHE_HOME=" + t.TempDir()}, "start", "--all", "--config", file, "--inspect-addr", inspect)

	tunneltest.Eventually(t, 20*time.Second, "the HTTP tunnel serving", func() bool { return serves(t, edgeHTTP, "web", "web") })
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+tcp, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if got, err := io.ReadAll(c); err != nil || string(got) != "shell\n" {
		t.Fatalf("through port %s: %q, %v", tcp, got, err)
	}
	c.Close()
	tc, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", "127.0.0.1:"+https, &tls.Config{ServerName: "secure.ngstone.test", RootCAs: roots})
	if err != nil {
		t.Fatalf("TLS through the edge, verifying the local service's certificate: %v", err)
	}
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	if line, err := bufio.NewReader(tc).ReadString('\n'); err != nil || line != "secure\n" {
		t.Fatalf("through the TLS tunnel: %q, %v", line, err)
	}
	tc.Close()

	listed := apiTunnels(t, inspect)
	for _, want := range []string{"web (http) http http://web.ngstone.test:" + ports[0], "shell tcp tcp://ngstone.test:" + tcp, "secure tls tls://secure.ngstone.test:" + https} {
		if !slices.Contains(listed, want) {
			t.Errorf("/api/tunnels lists %q, without %q", listed, want)
		}
	}
}

// apiTunnels lists the agent's local API's tunnels as "NAME PROTO URL".
func apiTunnels(t *testing.T, inspect string) []string {
	t.Helper()
	var list struct {
		Tunnels []struct {
			Name      string `json:"name"`
			Proto     string `json:"proto"`
			PublicURL string `json:"public_url"`
		} `json:"tunnels"`
	}
	resp, err := http.Get("http://" + inspect + "/api/tunnels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, tn := range list.Tunnels {
		listed = append(listed, tn.Name+" "+tn.Proto+" "+tn.PublicURL)
	}
	return listed
}
