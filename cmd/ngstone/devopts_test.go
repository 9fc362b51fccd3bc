package main

import (
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestAgentDeveloperOptions runs an edge and an agent process with the
// options a developer exposing a dev server reaches for: --host-header
// rewrite (the dev server checks Host), --basic-auth, --log-requests and
// --inspect-addr, and checks each from a visitor's side and on the
// inspector's API. The agent exits 0 on SIGINT and its inspector stops.
func TestAgentDeveloperOptions(t *testing.T) {
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.Host, "localhost:") {
			http.Error(w, "Blocked request. This host is not allowed.", http.StatusForbidden)
			return
		}
		b, _ := io.ReadAll(r.Body)
		io.WriteString(w, "dev server got "+string(b)+" for "+r.Header.Get("X-Forwarded-Host"))
	})
	data := t.TempDir()
	ports := freePorts(t, 4)
	startProc(t, nil, edgeArgs(data, ports)...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	inspect := "127.0.0.1:" + ports[3]
	ag := startProc(t, nil, "http", port, "--edge", "localhost:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
		"--subdomain", "dev", "--host-header", "rewrite", "--basic-auth", "alice:correct horse",
		"--log-requests", "--inspect-addr", inspect, "--log-format", "json")
	ag.waitLine(t, regexp.MustCompile(`^Forwarding http://dev\.ngstone\.test:`+ports[0]+` -> `))

	visitor := visitorClient(t, "127.0.0.1:"+ports[0])
	req, _ := http.NewRequest("POST", "http://dev.ngstone.test/hook", strings.NewReader("payload"))
	resp, err := visitor.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || resp.Header.Get("Ngstone-Error") != "basic_auth_required" || resp.Header.Get("WWW-Authenticate") == "" {
		t.Fatalf("without credentials: %d %v", resp.StatusCode, resp.Header)
	}
	req, _ = http.NewRequest("POST", "http://dev.ngstone.test/hook", strings.NewReader("payload"))
	req.SetBasicAuth("alice", "correct horse")
	resp, err = visitor.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := "dev server got payload for dev.ngstone.test"; resp.StatusCode != 200 || string(body) != want {
		t.Fatalf("with credentials: %d %q, want 200 %q", resp.StatusCode, body, want)
	}

	var caps []struct {
		ID                 uint64
		Method, Path, Code string
		Status             int
		Request            struct{ Head, Body string }
	}
	var code int
	var list string
	waitFor(t, 5*time.Second, "the inspector to keep both requests", func() bool {
		code, list, err = get(visitorClient(t, inspect), "http://"+inspect+"/api/requests")
		return err == nil && code == 200 && json.Unmarshal([]byte(list), &caps) == nil && len(caps) == 2
	})
	if c := caps[0]; c.Status != 200 || c.Path != "/hook" || !strings.Contains(c.Request.Head, "Host: localhost:"+port) || c.Request.Body != "cGF5bG9hZA==" {
		t.Errorf("inspector's newest request: %+v", c)
	}
	if c := caps[1]; c.Status != 401 || c.Code != "basic_auth_required" || !strings.HasPrefix(c.Request.Head, "POST /hook HTTP/1.1\r\n") {
		t.Errorf("inspector's refused request: %+v", c)
	}
	// The refused request's body never left the agent: it cannot be replayed.
	resp, err = visitorClient(t, inspect).Post("http://"+inspect+"/api/requests/"+strconv.FormatUint(caps[1].ID, 10)+"/replay", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusConflict {
		t.Errorf("replay of a request whose body was not kept: %d, want 409", resp.StatusCode)
	}
	for _, want := range []string{`"status":401,"code":"basic_auth_required"`, `"method":"POST","path":"/hook","status":200`, `"msg":"inspector"`, `"url":"http://` + inspect + `"`} {
		if !strings.Contains(ag.stderrText(), want) {
			t.Errorf("agent log lacks %s:\n%s", want, ag.stderrText())
		}
	}

	ag.cmd.Process.Signal(syscall.SIGINT)
	if code := ag.exitCode(t); code != 0 {
		t.Fatalf("agent exit %d after SIGINT", code)
	}
	c := visitorClient(t, inspect)
	c.Timeout = time.Second
	if _, _, err := get(c, "http://"+inspect+"/api/requests"); err == nil {
		t.Fatal("the inspector still answers after the agent exited")
	}
}
