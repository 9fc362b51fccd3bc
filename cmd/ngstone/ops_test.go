package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/config"
)

// The image's user (distroless nonroot).
const imageUID = 65532

// runBin runs the built binary to completion and returns its exit code and
// output.
func runBin(t *testing.T, cred *syscall.Credential, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, ngstoneBin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatalf("run %v: %v", args, err)
	}
	return code, out.String(), errOut.String()
}

func TestVersionStamped(t *testing.T) {
	code, out, _ := runBin(t, nil, nil, "version")
	if code != 0 {
		t.Fatalf("version exited %d", code)
	}
	for _, want := range []string{testVersion, testCommit, runtime.Version()} {
		if !strings.Contains(out, want) {
			t.Errorf("version printed %q, want it to name %s", out, want)
		}
	}
}

// edgeArgs runs an edge for ngstone.test on the given loopback ports
// (http, control, admin), no HTTPS listener.
func edgeArgs(data string, ports []string, extra ...string) []string {
	return append([]string{"edge", "--domain", "ngstone.test", "--data-dir", data,
		"--http-addr", "127.0.0.1:" + ports[0], "--https-addr=",
		"--control-addr", "127.0.0.1:" + ports[1], "--admin-addr", "127.0.0.1:" + ports[2],
		"--log-format", "json"}, extra...)
}

// TestHealthcheck: the healthcheck subcommand exits 0 against a healthy
// edge (admin address from the flag or, as in the image, from
// NGSTONE_ADMIN_ADDR; no admin token needed) and non-zero once it stopped.
func TestHealthcheck(t *testing.T) {
	ports := freePorts(t, 3)
	admin := "127.0.0.1:" + ports[2]
	e := startProc(t, []string{"NGSTONE_ADMIN_TOKEN=s3cret"}, edgeArgs(t.TempDir(), ports)...)
	waitHealthy(t, admin)

	if code, out, errOut := runBin(t, nil, nil, "healthcheck", "--admin-addr", admin); code != 0 || strings.TrimSpace(out) != "ok" {
		t.Fatalf("healthcheck of a healthy edge: exit %d, %q %q", code, out, errOut)
	}
	if code, _, errOut := runBin(t, nil, []string{"NGSTONE_ADMIN_ADDR=" + admin}, "healthcheck"); code != 0 {
		t.Fatalf("healthcheck with NGSTONE_ADMIN_ADDR: exit %d %q", code, errOut)
	}
	// The token guards the rest of the admin API.
	for auth, want := range map[string]int{"": 401, "Bearer s3cret": 200} {
		req, _ := http.NewRequest("GET", "http://"+admin+"/metrics", nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("/metrics with %q: %d, want %d", auth, resp.StatusCode, want)
		}
	}

	e.cmd.Process.Signal(syscall.SIGTERM)
	if code := e.exitCode(t); code != 0 {
		t.Fatalf("edge exited %d after SIGTERM", code)
	}
	if code, _, errOut := runBin(t, nil, nil, "healthcheck", "--admin-addr", admin, "--timeout", "2s"); code == 0 {
		t.Fatalf("healthcheck of a stopped edge exited 0 (%q)", errOut)
	}
}

// TestImageRuntime runs the binary as the image does: user 65532 with no
// groups, working directory / (not writable to it), settings from the
// environment, only its data directory writable. Skipped unless root (CI
// runs as root), since only root can switch users.
func TestImageRuntime(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the binary as the image's user 65532")
	}
	// MkdirTemp makes 0700 directories: open the binary's to everyone, as
	// /usr/local/bin is in the image.
	if err := os.Chmod(filepath.Dir(ngstoneBin), 0o755); err != nil {
		t.Fatal(err)
	}
	data, err := os.MkdirTemp("", "ngstone-data-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(data) })
	if err := os.Chmod(data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(data, imageUID, imageUID); err != nil {
		t.Fatal(err)
	}
	ports := freePorts(t, 4)
	admin := "127.0.0.1:" + ports[3]
	env := []string{
		"NGSTONE_DATA_DIR=" + data, "HOME=/home/nonroot", "NGSTONE_DOMAIN=ngstone.test",
		"NGSTONE_HTTP_ADDR=127.0.0.1:" + ports[0], "NGSTONE_HTTPS_ADDR=127.0.0.1:" + ports[1],
		"NGSTONE_CONTROL_ADDR=127.0.0.1:" + ports[2], "NGSTONE_ADMIN_ADDR=" + admin,
	}
	cred := &syscall.Credential{Uid: imageUID, Gid: imageUID}
	e := startProcAs(t, cred, "/", env, "edge")
	waitHealthy(t, admin)

	if uid := procUID(t, e.cmd.Process.Pid); uid != "65532" {
		t.Errorf("edge runs as uid %s, want 65532", uid)
	}
	st, err := os.Stat(filepath.Join(data, "ca.pem"))
	if err != nil {
		t.Fatalf("the edge did not write its CA into the data directory: %v", err)
	}
	if sys := st.Sys().(*syscall.Stat_t); sys.Uid != imageUID {
		t.Errorf("ca.pem owned by %d, want %d", sys.Uid, imageUID)
	}
	// The image's HEALTHCHECK: same user, same environment, no flags.
	if code, out, errOut := runBin(t, cred, env, "healthcheck"); code != 0 || strings.TrimSpace(out) != "ok" {
		t.Fatalf("healthcheck as 65532: exit %d %q %q", code, out, errOut)
	}
	e.cmd.Process.Signal(syscall.SIGTERM)
	if code := e.exitCode(t); code != 0 {
		t.Fatalf("edge exited %d after SIGTERM", code)
	}
	if code, _, _ := runBin(t, cred, env, "healthcheck", "--timeout", "2s"); code == 0 {
		t.Fatal("healthcheck of a stopped edge exited 0")
	}
}

// startProcAs starts the binary like startProc, as cred in dir with exactly
// env (plus PATH).
func startProcAs(t *testing.T, cred *syscall.Credential, dir string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(ngstoneBin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	return runProc(t, cmd)
}

// procUID returns the real uid of process pid.
func procUID(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "Uid:" {
			return f[1]
		}
	}
	t.Fatal("no Uid in /proc status")
	return ""
}

// visitorClient sends every request to the edge's HTTP listener at addr,
// whatever host the URL names.
func visitorClient(t *testing.T, addr string) *http.Client {
	d := &net.Dialer{Timeout: 2 * time.Second}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "tcp", addr)
		},
		DisableKeepAlives: true,
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

func get(c *http.Client, url string) (int, string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestEdgeSIGTERM: SIGTERM with a slow request in flight. The edge stops
// accepting visitors and tells the agent to go away; the request still
// completes with 200; the edge exits 0; a new edge process on the same ports
// and data directory serves the agent again within the agent's current
// backoff step.
func TestEdgeSIGTERM(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	_, port := backend(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
			io.WriteString(w, "slow done")
			return
		}
		io.WriteString(w, "hello")
	})
	data := t.TempDir()
	ports := freePorts(t, 3)
	visitors, admin := "127.0.0.1:"+ports[0], "127.0.0.1:"+ports[2]
	args := edgeArgs(data, ports, "--shutdown-grace", "10s", "--heartbeat-timeout", "2s")
	e1 := startProc(t, nil, args...)
	waitHealthy(t, admin)
	a := startProc(t, nil, "http", port, "--edge", "127.0.0.1:"+ports[1], "--ca-file", filepath.Join(data, "ca.pem"),
		"--subdomain", "app", "--heartbeat-interval", "100ms", "--heartbeat-timeout", "1s", "--dial-timeout", "1s",
		"--drain-timeout", "10s", "--log-format", "json", "--log-level", "debug")
	a.waitLine(t, regexp.MustCompile(`^Forwarding http://app\.ngstone\.test:`+ports[0]+` -> `))
	c := visitorClient(t, visitors)

	type result struct {
		code int
		body string
		err  error
	}
	slow := make(chan result, 1)
	go func() {
		code, body, err := get(c, "http://app.ngstone.test/slow")
		slow <- result{code, body, err}
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the slow request never reached the backend")
	}
	e1.cmd.Process.Signal(syscall.SIGTERM)

	// Shutting down, with the request still in flight: no new visitors,
	// and the agent still connected to answer it.
	waitFor(t, 5*time.Second, "the edge to stop accepting visitors", func() bool {
		conn, err := net.DialTimeout("tcp", visitors, time.Second)
		if err == nil {
			conn.Close()
		}
		return err != nil
	})
	if strings.Contains(a.stderrText(), "the edge is shutting down") {
		t.Fatal("the agent was told to go away with a request of its in flight")
	}
	select {
	case r := <-slow:
		t.Fatalf("the slow request ended before it was released: %+v", r)
	case <-e1.exited:
		t.Fatal("the edge exited with a request in flight")
	default:
	}
	close(release)
	if r := <-slow; r.err != nil || r.code != 200 || r.body != "slow done" {
		t.Fatalf("in-flight request across SIGTERM: %d %q %v", r.code, r.body, r.err)
	}
	// Then the agents are told to go away.
	waitFor(t, 5*time.Second, "the agent to hear goaway", func() bool {
		return strings.Contains(a.stderrText(), "the edge is shutting down")
	})
	if code := e1.exitCode(t); code != 0 {
		t.Fatalf("edge exited %d after SIGTERM", code)
	}

	startProc(t, nil, args...)
	waitHealthy(t, admin)
	ready := time.Now()
	waitFor(t, 35*time.Second, "the agent to serve through the new edge", func() bool {
		code, body, _ := get(c, "http://app.ngstone.test/hello")
		return code == 200 && body == "hello"
	})
	took := time.Since(ready)
	step := longestBackoff(t, a.stderrText())
	t.Logf("serving again %s after the new edge was ready; longest backoff step %s", took.Round(time.Millisecond), step)
	if step == 0 {
		t.Fatal("the agent logged no reconnect backoff")
	}
	// One backoff step, plus a dial, hello and bind on loopback.
	if took > step+time.Second {
		t.Errorf("the agent took %s to come back, more than its backoff step %s", took, step)
	}
}

// longestBackoff returns the longest "in" of the agent's JSON "reconnect
// attempt" log lines (debug: one per attempt).
func longestBackoff(t *testing.T, logs string) time.Duration {
	var longest time.Duration
	for _, l := range strings.Split(logs, "\n") {
		var rec struct {
			Msg string        `json:"msg"`
			In  time.Duration `json:"in"`
		}
		if json.Unmarshal([]byte(l), &rec) == nil && rec.Msg == "reconnect attempt" && rec.In > longest {
			longest = rec.In
		}
	}
	return longest
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDockerfile pins what TestImageRuntime assumes about the image, and
// checks that the commands and variables the Dockerfile names exist.
func TestDockerfile(t *testing.T) {
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	inst := map[string][]string{} // instruction -> arguments, continuations joined
	for _, l := range strings.Split(strings.ReplaceAll(string(b), "\\\n", " "), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		k, v, _ := strings.Cut(l, " ")
		inst[k] = append(inst[k], strings.Join(strings.Fields(v), " "))
	}
	all := func(k string) string { return strings.Join(inst[k], "\n") }
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "-X main.version=${VERSION}", "-X main.commit=${COMMIT}"} {
		if !strings.Contains(all("RUN"), want) {
			t.Errorf("the build step lacks %s", want)
		}
	}
	if from := inst["FROM"]; len(from) < 2 || !strings.Contains(from[len(from)-1], "distroless/static") {
		t.Errorf("runtime image %v: want distroless static", from)
	}
	if u := all("USER"); u != strconv.Itoa(imageUID)+":"+strconv.Itoa(imageUID) {
		t.Errorf("USER %q: want %d:%d, the user TestImageRuntime runs as", u, imageUID, imageUID)
	}
	if !strings.Contains(all("COPY"), "--chown=65532:65532") || all("VOLUME") != "/data" || !strings.Contains(all("ENV"), "NGSTONE_DATA_DIR=/data") {
		t.Errorf("want /data owned by the runtime user, a VOLUME and NGSTONE_DATA_DIR: COPY %q VOLUME %q ENV %q", all("COPY"), all("VOLUME"), all("ENV"))
	}
	if all("EXPOSE") != "80 443 4443" {
		t.Errorf("EXPOSE %q", all("EXPOSE"))
	}
	fs := pflag.NewFlagSet("edge", pflag.ContinueOnError)
	config.NewEdge(fs)
	for _, kv := range strings.Fields(all("ENV")) {
		k, _, _ := strings.Cut(kv, "=")
		name, ok := strings.CutPrefix(k, "NGSTONE_")
		if !ok || fs.Lookup(strings.ReplaceAll(strings.ToLower(name), "_", "-")) == nil {
			t.Errorf("ENV %s is not an edge flag's variable", k)
		}
	}
	for k, want := range map[string][]string{
		"ENTRYPOINT":  {"/usr/local/bin/ngstone", "edge"},
		"HEALTHCHECK": {"/usr/local/bin/ngstone", "healthcheck"},
	} {
		v := all(k)
		var got []string
		if i := strings.Index(v, "["); i < 0 || json.Unmarshal([]byte(v[i:]), &got) != nil || !slices.Equal(got, want) {
			t.Errorf("%s %q: want exec form %q", k, v, want)
			continue
		}
		if cmd, _, err := newRoot().Find(got[1:]); err != nil || cmd.Name() != got[1] {
			t.Errorf("%s runs `ngstone %s`, which the CLI does not have", k, got[1])
		}
	}
}
