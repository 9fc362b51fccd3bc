package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// The console's scenario, with durations a tenth of what they are by
// default so that it takes seconds: the backoff's base and cap
// (--backoff-base 50ms --backoff-cap 3s against 500ms and 30s) and the
// console's redraw (--console-refresh 100ms against 1s). An outage of
// outage is then as many reconnect attempts and redraws as one of ten
// times as long with the defaults.
const outage = 3 * time.Second

// agentScenarioArgs are the agent's flags in both runs of the scenario.
func agentScenarioArgs(port, control, data string) []string {
	return []string{"http", port, "--edge", "127.0.0.1:" + control, "--ca-file", filepath.Join(data, "ca.pem"),
		"--subdomain", "live", "--inspect-addr", "127.0.0.1:0",
		"--backoff-base", "50ms", "--backoff-cap", "3s", "--console-refresh", "100ms",
		// Long enough that a stopped agent, once continued, reads its
		// eviction before it gives up on its session itself.
		"--heartbeat-interval", "100ms", "--heartbeat-timeout", "30s", "--log-requests"}
}

// scenarioEdge runs the edge of the scenario and restarts it.
type scenarioEdge struct {
	t     *testing.T
	data  string
	ports []string
	p     *proc
}

func startScenarioEdge(t *testing.T) *scenarioEdge {
	e := &scenarioEdge{t: t, data: t.TempDir(), ports: freePorts(t, 3)}
	e.start()
	return e
}

func (e *scenarioEdge) args() []string {
	// An agent silent for a second is dead: the stopped agent's name can
	// be taken over soon.
	return edgeArgs(e.data, e.ports, "--heartbeat-timeout", "1s")
}

func (e *scenarioEdge) start() {
	e.p = startProc(e.t, nil, e.args()...)
	waitHealthy(e.t, "127.0.0.1:"+e.ports[2])
}

// kill ends the edge as a crash would: no goaway, nothing listening.
func (e *scenarioEdge) kill() {
	e.p.cmd.Process.Kill()
	<-e.p.exited
}

func (e *scenarioEdge) visit(t *testing.T, path string) int {
	t.Helper()
	code, _, err := get(visitorClient(t, "127.0.0.1:"+e.ports[0]), "http://live.ngstone.test"+path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return code
}

// waitOffline waits until the edge's admin API shows the tunnel offline.
func (e *scenarioEdge) waitOffline(t *testing.T) {
	t.Helper()
	c := visitorClient(t, "127.0.0.1:"+e.ports[2])
	var body string
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		_, body, err = get(c, "http://127.0.0.1:"+e.ports[2]+"/api/tunnels/live.ngstone.test")
		if err == nil && strings.Contains(body, `"online": false`) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the edge never saw the stopped agent offline: %s %v", body, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// takeOver starts another agent (another instance) for the name, which
// takes it from a holder the edge sees dead.
func (e *scenarioEdge) takeOver(t *testing.T, port string) *proc {
	t.Helper()
	other := startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+e.ports[1], "--ca-file", filepath.Join(e.data, "ca.pem"),
		"--subdomain", "live", "--inspect=false")
	other.waitLine(t, regexp.MustCompile(`^Forwarding http://live\.ngstone\.test:`))
	return other
}

func scenarioBackend(t *testing.T) string {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/missing" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, "hello")
	})
	return port
}

// TestConsoleOnATerminal drives `ngstone http` in a real pseudo-terminal
// (tmux, 120x40) through the scenario: online, requests flowing, an edge
// that crashes and comes back, and an eviction; it keeps a snapshot of the
// screen at each step (tunneltest.ArtifactDir) and checks that the screen
// stays one screen: no line scrolls into the terminal's history over the
// outage. About 8 s.
func TestConsoleOnATerminal(t *testing.T) {
	port := scenarioBackend(t)
	e := startScenarioEdge(t)
	art := tunneltest.ArtifactDir(t)
	pane := startTmux(t, 120, 40, agentScenarioArgs(port, e.ports[1], e.data)...)

	online := pane.waitScreen(t, "online", func(s string) bool {
		return strings.Contains(s, "Session Status                online") && strings.Contains(s, "Forwarding                    http://live.ngstone.test:"+e.ports[0]+" -> http://localhost:"+port)
	})
	pane.snapshot(t, art, "1-online", online)
	for _, want := range []string{"Version                       " + testVersion, "Web Interface                 http://127.0.0.1:", "Edge                          127.0.0.1:" + e.ports[1] + " · latency ", "Connections"} {
		if !strings.Contains(online, want) {
			t.Errorf("online screen lacks %q:\n%s", want, online)
		}
	}
	for _, path := range []string{"/", "/hook", "/missing"} {
		e.visit(t, path)
	}
	// The counters with all three closed: a request counts as closed only
	// once the agent is done with it, which can be after its visitor has
	// the answer and has sent the next one, so they are waited on too.
	counters := regexp.MustCompile(`\n {30}3 +0 +0\.05 +0\.01 +[\d.]+(µs|ms) +[\d.]+(µs|ms)`)
	flowing := pane.waitScreen(t, "the requests, and the connection counters (ttl 3, opn 0, rt1 3/60, rt5 3/300, p50, p90)", func(s string) bool {
		return regexp.MustCompile(`\d\d:\d\d:\d\d\.\d{3}  GET     /missing +404`).MatchString(s) && strings.Contains(s, "/hook") && counters.MatchString(s)
	})
	pane.snapshot(t, art, "2-requests", flowing)

	before := pane.history(t)
	e.kill()
	pane.waitScreen(t, "the outage", func(s string) bool {
		return strings.Contains(s, "reconnecting · attempt") && strings.Contains(s, "is the edge running at 127.0.0.1:"+e.ports[1]+"?")
	})
	time.Sleep(outage) // the outage itself: the screen is watched over it, not waited on
	down := pane.capture(t)
	pane.snapshot(t, art, "3-outage", down)
	attempt := regexp.MustCompile(`attempt (\d+)`).FindStringSubmatch(down)
	scrolled := pane.history(t) - before
	t.Logf("over a %s outage (as a %s one with the default durations): %s reconnect attempts, %d lines scrolled into the terminal's history",
		outage, 10*outage, attempt[1], scrolled)
	if scrolled != 0 {
		t.Errorf("%d lines scrolled off the screen during the outage; the console must redraw in place:\n%s", scrolled, pane.scrolled(t))
	}
	if n, _ := strconv.Atoi(attempt[1]); n < 3 {
		t.Errorf("only %d attempts in the outage: the scenario did not exercise the redraw", n)
	}
	e.start()
	pane.waitScreen(t, "online again", func(s string) bool {
		return strings.Contains(s, "Session Status                online") && !strings.Contains(s, "What to do")
	})

	// Evicted: the agent is stopped past the edge's heartbeat timeout,
	// another instance takes the name, and the agent, continued, learns it.
	pid := pane.pid(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	e.waitOffline(t)
	e.takeOver(t, port)
	syscall.Kill(pid, syscall.SIGCONT)
	evicted := pane.waitScreen(t, "the eviction", func(s string) bool { return strings.Contains(s, "exit code 4") })
	pane.snapshot(t, art, "4-evicted", evicted)
	// Evicted By names the agent that took the name, by what the edge's
	// admin API shows of it (the line wraps at spaces).
	taker := edgeBindings(t, "127.0.0.1:"+e.ports[2])["live"]["instance_id"]
	by := regexp.MustCompile(`Evicted By +another agent \(instance\s+` + fmt.Sprint(taker) + `\)\s+took\s+live\.ngstone\.test\s+over\s+while\s+this\s+one\s+was\s+unreachable\s+\((takeover|subdomain_taken)\)`)
	if !strings.Contains(evicted, "Session Status                evicted at ") || !by.MatchString(evicted) ||
		!strings.Contains(evicted, "none: this agent no longer serves the name") {
		t.Errorf("evicted screen (taken by %v):\n%s", taker, evicted)
	}
	if dead, code := pane.waitExit(t); !dead || code != exitEvicted {
		t.Errorf("agent: dead %v, exit %d; want exit %d", dead, code, exitEvicted)
	}
	if total := pane.history(t); total > 2 {
		t.Errorf("%d lines in the terminal's history over the whole run:\n%s", total, pane.scrolled(t))
	}
}

// TestConsoleOffATerminal: the same scenario with stdout and stderr piped:
// nothing redraws, one log line per change of state (none per attempt),
// and the Forwarding lines on stdout at each binding. About 7 s.
func TestConsoleOffATerminal(t *testing.T) {
	port := scenarioBackend(t)
	e := startScenarioEdge(t)
	a := startProc(t, nil, append(agentScenarioArgs(port, e.ports[1], e.data), "--log-level", "debug")...)
	fwd := regexp.MustCompile(`^Forwarding http://live\.ngstone\.test:` + e.ports[0] + ` -> http://localhost:` + port + `$`)
	a.waitLine(t, fwd)
	for _, path := range []string{"/", "/missing"} {
		e.visit(t, path)
	}
	e.kill()
	waitFor(t, 10*time.Second, "the outage's hint", func() bool { return strings.Contains(a.stderrText(), "is the edge running at") })
	time.Sleep(outage)
	e.start()
	a.waitLine(t, fwd) // again, after the rebind
	pid := a.cmd.Process.Pid
	syscall.Kill(pid, syscall.SIGSTOP)
	e.waitOffline(t)
	e.takeOver(t, port)
	syscall.Kill(pid, syscall.SIGCONT)
	if code := a.exitCode(t); code != exitEvicted {
		t.Fatalf("exit %d, want %d", code, exitEvicted)
	}
	logs := a.stderrText()
	// The evicted line names the agent that took the name over.
	taker := edgeBindings(t, "127.0.0.1:"+e.ports[2])["live"]["instance_id"]
	if !regexp.MustCompile(`"msg":"evicted".*"by":"another agent \(instance ` + fmt.Sprint(taker) + `\)"`).MatchString(logs) {
		t.Errorf("the evicted line does not name %v:\n%s", taker, logs)
	}
	// So does the last sentence, after the log.
	if last := regexp.MustCompile(`(?m)^ngstone: another agent \(instance ` + fmt.Sprint(taker) + `\) took over this tunnel's name while this one was unreachable; it no longer serves it$`); !last.MatchString(logs) {
		t.Errorf("the last sentence does not name %v:\n%s", taker, logs)
	}
	var states []string
	attempts := 0
	for _, l := range strings.Split(strings.TrimSpace(logs), "\n") {
		var rec struct{ Level, Msg string }
		if json.Unmarshal([]byte(l), &rec) != nil {
			continue
		}
		switch {
		case rec.Msg == "reconnect attempt":
			attempts++
		case rec.Level == "DEBUG", rec.Msg == "request", rec.Msg == "inspector":
		default:
			states = append(states, rec.Msg)
		}
	}
	t.Logf("%d reconnect attempts (debug lines), %d lines of state over the run: %s", attempts, len(states), strings.Join(states, ", "))
	// When the edge closed the stopped agent's silent session before the
	// takeover, the agent, continued, sees its session gone and retries
	// once before it learns its name is another's.
	end := states
	if n := len(end); n >= 2 && end[n-2] == "reconnecting" {
		end = append(end[:n-2:n-2], end[n-1])
	}
	n := len(end)
	if n < 5 || end[0] != "connecting" || end[1] != "online" || end[n-2] != "online" || end[n-1] != "evicted" {
		t.Fatalf("state lines %q, want connecting, online, reconnecting..., online, [reconnecting,] evicted", states)
	}
	// One when the session is lost, one when the cause changes to a
	// refused dial, perhaps one more while the edge starts again: never
	// one per attempt.
	for _, st := range end[2 : n-2] {
		if st != "reconnecting" {
			t.Errorf("state lines %q: want only reconnecting during the outage", states)
		}
	}
	if n-4 > 3 || attempts < 3 {
		t.Errorf("%d reconnecting lines for %d attempts", n-4, attempts)
	}
	if n := strings.Count(logs, `"msg":"request"`); n != 2 {
		t.Errorf("%d request lines, want 2:\n%s", n, logs)
	}
	if strings.Contains(logs, "\x1b[") {
		t.Errorf("escape codes off a terminal:\n%q", logs)
	}
}

// tmuxPane is one program in the pane of a tmux server of the test's own.
type tmuxPane struct {
	bin, sock string
	code      string // the file the pane's shell writes the program's exit status to
}

// startTmux runs ngstone with args in a width x height pane; the pane stays
// when the program exits, for its last screen and exit status.
func startTmux(t *testing.T, width, height int, args ...string) *tmuxPane {
	t.Helper()
	p := &tmuxPane{bin: tunneltest.Tool(t, "tmux")}
	dir, err := os.MkdirTemp("", "tmux") // short: a socket path has a limit
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p.sock = filepath.Join(dir, "s")
	conf := filepath.Join(dir, "tmux.conf")
	if err := os.WriteFile(conf, []byte("set -g status off\nset -g remain-on-exit on\nset -g history-limit 10000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Not exec'd: tmux continues a process of its own that is stopped,
	// and the scenario stops the agent (pid finds it under the shell).
	cmdline := "env TERM=xterm-256color XDG_CACHE_HOME=" + shellQuote(os.Getenv("XDG_CACHE_HOME")) + " " + shellQuote(ngstoneBin)
	for _, a := range args {
		cmdline += " " + shellQuote(a)
	}
	// The status is kept by the shell too: tmux has shown a dead pane's
	// status as 0 or not at all under load.
	p.code = filepath.Join(dir, "code")
	cmdline += "; c=$?; echo $c > " + shellQuote(p.code) + "; exit $c"
	if out, err := exec.Command(p.bin, "-S", p.sock, "-f", conf, "new-session", "-d", "-x", strconv.Itoa(width), "-y", strconv.Itoa(height), "-s", "t", cmdline).CombinedOutput(); err != nil {
		t.Fatalf("tmux: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last screen:\n%s", p.capture(t))
		}
		exec.Command(p.bin, "-S", p.sock, "kill-server").Run()
	})
	return p
}

func (p *tmuxPane) tmux(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(p.bin, append([]string{"-S", p.sock}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("tmux %v: %v: %s", args, err, out)
	}
	return string(out)
}

// capture is the screen as text.
func (p *tmuxPane) capture(t *testing.T) string { return p.tmux(t, "capture-pane", "-p", "-t", "t") }

func (p *tmuxPane) format(t *testing.T, f string) string {
	return strings.TrimSpace(p.tmux(t, "display-message", "-p", "-t", "t", f))
}

// scrolled is what has scrolled off the top of the screen, as text.
func (p *tmuxPane) scrolled(t *testing.T) string {
	return p.tmux(t, "capture-pane", "-p", "-t", "t", "-S", "-", "-E", "-1")
}

// history is how many lines have scrolled off the top of the screen.
func (p *tmuxPane) history(t *testing.T) int {
	n, err := strconv.Atoi(p.format(t, "#{history_size}"))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// pid is the agent's process id: the child of the pane's shell.
func (p *tmuxPane) pid(t *testing.T) int {
	sh := p.format(t, "#{pane_pid}")
	b, err := os.ReadFile("/proc/" + sh + "/task/" + sh + "/children")
	n, aerr := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || aerr != nil {
		t.Fatalf("the agent under the pane's shell %s: %q %v %v", sh, b, err, aerr)
	}
	return n
}

// waitExit is exit once the program has had a few seconds to exit: its
// last screen shows a moment before the pane's shell has seen it end.
func (p *tmuxPane) waitExit(t *testing.T) (bool, int) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		dead, code := p.exit(t)
		if dead || time.Now().After(deadline) {
			return dead, code
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// exit reports whether the program has exited, and its exit status, as
// the pane's shell wrote it; a dead pane's file is waited for, a few
// seconds at most.
func (p *tmuxPane) exit(t *testing.T) (bool, int) {
	var dead int
	fmt.Sscan(p.format(t, "#{pane_dead}"), &dead)
	if dead != 1 {
		return false, 0
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(p.code)
		code, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err == nil {
			return true, code
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pane is dead but its shell wrote no exit status (%q)", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (p *tmuxPane) waitScreen(t *testing.T, what string, ok func(string) bool) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		s := p.capture(t)
		if ok(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("the screen never showed %s:\n%s", what, s)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// snapshot keeps screen as NAME.txt, and with its colours as NAME.ansi.
func (p *tmuxPane) snapshot(t *testing.T, dir, name, screen string) {
	t.Helper()
	os.WriteFile(filepath.Join(dir, name+".txt"), []byte(screen), 0o644)
	os.WriteFile(filepath.Join(dir, name+".ansi"), []byte(p.tmux(t, "capture-pane", "-p", "-e", "-t", "t")), 0o644)
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// TestConsoleCtrlC: Ctrl+C on the console's terminal (a key, the terminal
// being raw) stops the agent gracefully: the name is released, the last
// screen says stopped, the exit code is 0. About 2 s.
func TestConsoleCtrlC(t *testing.T) {
	port := scenarioBackend(t)
	e := startScenarioEdge(t)
	pane := startTmux(t, 120, 40, agentScenarioArgs(port, e.ports[1], e.data)...)
	pane.waitScreen(t, "online", func(s string) bool { return strings.Contains(s, "Session Status                online") })
	pane.tmux(t, "send-keys", "-t", "t", "C-c")
	stopped := pane.waitScreen(t, "the stop", func(s string) bool {
		return strings.Contains(s, "Session Status                stopped · exit code 0")
	})
	if dead, code := pane.waitExit(t); !dead || code != 0 {
		t.Errorf("after Ctrl+C: dead %v, exit %d:\n%s", dead, code, stopped)
	}
	c := visitorClient(t, "127.0.0.1:"+e.ports[2])
	if _, body, err := get(c, "http://127.0.0.1:"+e.ports[2]+"/api/tunnels"); err != nil || strings.Contains(body, "live.ngstone.test") {
		t.Errorf("the name is still bound after Ctrl+C: %s %v", body, err)
	}
}
