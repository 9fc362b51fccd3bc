package main

import (
	"encoding/json"
	"net"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/config"
)

// TestUsageErrors: a typo'd flag names the flag meant, a missing PORT says
// what to give with an example, --version prints the version, each with
// the usage exit code where it is an error.
func TestUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		code int
		want []string
	}{
		{"typo", []string{"http", "--subdomian", "demo", "3000"}, exitUsage, []string{"unknown flag --subdomian: did you mean --subdomain?"}},
		{"typo with a value", []string{"http", "--inspect-adr=127.0.0.1:4041", "3000"}, exitUsage, []string{"did you mean --inspect-addr?"}},
		{"typo on the edge", []string{"edge", "--domian", "example.com"}, exitUsage, []string{"did you mean --domain?"}},
		{"nothing close", []string{"http", "--zzzzzzzz", "3000"}, exitUsage, []string{"unknown flag --zzzzzzzz (ngstone http --help lists them)"}},
		{"missing PORT", []string{"http"}, exitUsage, []string{"missing PORT", "`ngstone http 3000`"}},
		{"two ports", []string{"http", "3000", "4000"}, exitUsage, []string{"one local service at a time: got 2 (3000, 4000)"}},
		{"version flag", []string{"--version"}, 0, []string{"ngstone " + testVersion + " (commit " + testCommit}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runBin(t, nil, nil, tc.args...)
			if code != tc.code {
				t.Errorf("exit %d, want %d", code, tc.code)
			}
			for _, w := range tc.want {
				if !strings.Contains(out+errOut, w) {
					t.Errorf("output lacks %q:\nstdout %s\nstderr %s", w, out, errOut)
				}
			}
		})
	}
}

// TestEdgeHelpGrouped: `ngstone edge --help` lists its flags in sections,
// in order, each flag exactly once, every flag but the general ones in a
// section.
func TestEdgeHelpGrouped(t *testing.T) {
	code, out, _ := runBin(t, nil, nil, "edge", "--help")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	at := -1
	for _, h := range append([]string{"Flags:"}, "Visitors flags:", "TLS flags:", "Agents flags:", "Cluster flags:", "Limits flags:", "Admin flags:") {
		i := strings.Index(out, "\n"+h+"\n")
		if i <= at {
			t.Fatalf("section %q missing or out of order:\n%s", h, out)
		}
		at = i
	}
	fs := pflag.NewFlagSet("edge", pflag.ContinueOnError)
	config.NewEdge(fs)
	general := map[string]bool{"domain": true, "config": true, "log-format": true, "log-level": true}
	fs.VisitAll(func(f *pflag.Flag) {
		if n := len(regexp.MustCompile(`(?m)^\s+(-\w, )?--`+regexp.QuoteMeta(f.Name)+`\s`).FindAllString(out, -1)); n != 1 {
			t.Errorf("--%s appears %d times in --help", f.Name, n)
		}
		if len(f.Annotations[config.FlagGroup]) == 0 && !general[f.Name] {
			t.Errorf("--%s is in no section", f.Name)
		}
	})
	general["help"] = true
	gen := out[strings.Index(out, "\nFlags:\n"):strings.Index(out, "\nVisitors flags:\n")]
	for _, l := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z-]+)`).FindAllStringSubmatch(gen, -1) {
		if !general[l[1]] {
			t.Errorf("--%s among the general flags", l[1])
		}
	}
}

// TestEdgeLogsStructured: the edge's start line gives its addresses as
// fields, not as Go's map syntax, in text and in JSON.
func TestEdgeLogsStructured(t *testing.T) {
	ports := freePorts(t, 3)
	text := startProc(t, nil, append(edgeArgs(t.TempDir(), ports), "--log-format", "text")...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	waitFor(t, 5*time.Second, "the start line", func() bool { return strings.Contains(text.stderrText(), "edge started") })
	if s := text.stderrText(); strings.Contains(s, "map[") || !strings.Contains(s, "addrs.control=127.0.0.1:"+ports[1]) || !strings.Contains(s, "addrs.http=127.0.0.1:"+ports[0]) {
		t.Errorf("text start line:\n%s", s)
	}
	text.cmd.Process.Kill()
	<-text.exited
	js := startProc(t, nil, edgeArgs(t.TempDir(), ports)...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	waitFor(t, 5*time.Second, "the start line", func() bool { return strings.Contains(js.stderrText(), "edge started") })
	for _, l := range strings.Split(js.stderrText(), "\n") {
		var rec struct {
			Msg   string            `json:"msg"`
			Addrs map[string]string `json:"addrs"`
		}
		if json.Unmarshal([]byte(l), &rec) == nil && rec.Msg == "edge started" {
			if rec.Addrs["admin"] != "127.0.0.1:"+ports[2] {
				t.Errorf("JSON start line: %s", l)
			}
			return
		}
	}
	t.Errorf("no JSON start line:\n%s", js.stderrText())
}

// TestInspectorOnByDefault: an agent started without inspector flags
// serves the inspector and the local API on 127.0.0.1:4040 (the first free
// port from there), a second takes the next free one, and each one's
// /api/tunnels gives its own public URL in ngrok's shape; --inspect=false
// turns it off.
func TestInspectorOnByDefault(t *testing.T) {
	free := freeInRange(t, 4040, 4049)
	if len(free) < 2 {
		t.Fatalf("only %v of 127.0.0.1:4040-4049 free: another program holds the inspector's ports", free)
	}
	t.Logf("free inspector ports before the agents: %v", free)
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {})
	data := t.TempDir()
	ports := freePorts(t, 3)
	startProc(t, nil, edgeArgs(data, ports)...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	agentFor := func(name string, extra ...string) (*proc, string) {
		a := startProc(t, nil, append([]string{"http", port, "--edge", "127.0.0.1:" + ports[1], "--ca-file", filepath.Join(data, "ca.pem"), "--subdomain", name}, extra...)...)
		m := a.waitLine(t, regexp.MustCompile(`^Forwarding (\S+) -> `))
		return a, m[1]
	}
	one, url1 := agentFor("one")
	two, url2 := agentFor("two")
	for i, a := range []struct {
		p   *proc
		url string
	}{{one, url1}, {two, url2}} {
		addr := "127.0.0.1:" + strconv.Itoa(free[i])
		var list struct {
			Tunnels []struct {
				Name      string `json:"name"`
				PublicURL string `json:"public_url"`
				Proto     string `json:"proto"`
				Config    struct {
					Addr string `json:"addr"`
				} `json:"config"`
			} `json:"tunnels"`
		}
		code, body, err := get(visitorClient(t, addr), "http://"+addr+"/api/tunnels")
		if err != nil || code != 200 || json.Unmarshal([]byte(body), &list) != nil || len(list.Tunnels) != 1 {
			t.Fatalf("agent %d: GET %s/api/tunnels: %d %v %s\n%s", i+1, addr, code, err, body, a.p.stderrText())
		}
		if tn := list.Tunnels[0]; tn.PublicURL != a.url || tn.Name != "command_line" || tn.Proto != "http" || tn.Config.Addr != "http://localhost:"+port {
			t.Errorf("agent %d at %s: %+v, want %s", i+1, addr, tn, a.url)
		}
		t.Logf("agent %d: curl %s/api/tunnels -> %s", i+1, addr, list.Tunnels[0].PublicURL)
	}
	off, _ := agentFor("three", "--inspect=false", "--log-format", "json")
	if s := off.stderrText(); strings.Contains(s, `"msg":"inspector"`) {
		t.Errorf("--inspect=false started an inspector:\n%s", s)
	}
}

// freeInRange lists the loopback ports from..to that can be bound now.
func freeInRange(t *testing.T, from, to int) []int {
	var free []int
	for p := from; p <= to; p++ {
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err == nil {
			ln.Close()
			free = append(free, p)
		}
	}
	return free
}
