package main

import (
	"bytes"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
)

// TestEdgeDataDirOfAnotherUser: an edge alone binds a name and is killed
// (SIGKILL), then started again as user nobody on the same --data-dir,
// which root owns (its CA handed to nobody, as an operator who moved the
// edge to another user might). A registry.db nobody may not read and
// write, in a directory it may not write or in one it may, stops the edge
// with an error that names the file, the user and the fix, and calls it a
// permission problem, not a foreign file to move away; the file is left as
// it was. Handed to nobody in root's directory, it is opened, and the name
// is still owned. A fresh --data-dir nobody may not write stops the edge
// too. Only root can switch users, so the test needs root (CI runs as
// root).
func TestEdgeDataDirOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the edge as user nobody")
	}
	nobody, err := user.Lookup("nobody")
	if err != nil {
		t.Skip("no user nobody:", err)
	}
	uid, _ := strconv.Atoi(nobody.Uid)
	gid, _ := strconv.Atoi(nobody.Gid)
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	// MkdirTemp makes 0700 directories: open the binary's to everyone.
	if err := os.Chmod(filepath.Dir(ngstoneBin), 0o755); err != nil {
		t.Fatal(err)
	}
	data := rootDir(t)
	reg := filepath.Join(data, "registry.db")
	ports := freePorts(t, 3)
	admin := "127.0.0.1:" + ports[2]
	args := edgeArgs(data, ports, "--heartbeat-timeout", "1m")

	e := startProc(t, nil, args...)
	waitHealthy(t, admin)
	roots := dataDirCA(t, data)
	(&rawEdgeAgent{control: "127.0.0.1:" + ports[1], roots: roots, id: agent.NewInstanceID()}).bindOnce(t)
	e.cmd.Process.Signal(syscall.SIGKILL)
	<-e.exited
	for _, f := range []string{"ca.pem", "ca-key.pem"} {
		chown(t, filepath.Join(data, f), uid, gid)
	}
	before, err := os.ReadFile(reg)
	if err != nil {
		t.Fatal(err)
	}

	refused := func(what, dir string, want ...string) {
		t.Helper()
		p := startProcAs(t, cred, "/", nil, args...)
		if startedInstead(t, p, admin) {
			t.Fatalf("%s: the edge started as nobody, listing %d tunnels; want it stopped", what, len(tunnels(t, admin)))
		}
		if code := p.exitCode(t); code != exitError {
			t.Fatalf("%s: exit %d, want %d", what, code, exitError)
		}
		s := p.stderrText()
		for _, w := range append(want, "nobody", "permission denied") {
			if !strings.Contains(s, w) {
				t.Errorf("%s: the error does not say %q:\n%s", what, w, s)
			}
		}
		if strings.Contains(s, "move it away") || strings.Contains(s, "not an ngstone registry") {
			t.Errorf("%s: the error calls a valid registry foreign:\n%s", what, s)
		}
		if after, _ := os.ReadFile(reg); dir == data && !bytes.Equal(after, before) {
			t.Errorf("%s: registry.db was changed", what)
		}
	}
	refused("root's registry in root's directory", data, reg, "chown")
	chown(t, data, uid, gid)
	refused("root's registry in nobody's directory", data, reg, "chown")

	chown(t, data, 0, 0)
	chown(t, reg, uid, gid)
	p := startProcAs(t, cred, "/", nil, args...)
	if !startedInstead(t, p, admin) {
		t.Fatalf("nobody's registry in root's directory: the edge did not start:\n%s", p.stderrText())
	}
	if ts := tunnels(t, admin); len(ts) != 1 || ts[0]["hostname"] != "probe.ngstone.test" {
		t.Fatalf("nobody's registry in root's directory: the edge lists %v, want probe.ngstone.test still owned", ts)
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited

	fresh := rootDir(t)
	for _, f := range []string{"ca.pem", "ca-key.pem"} {
		b, _ := os.ReadFile(filepath.Join(data, f))
		if err := os.WriteFile(filepath.Join(fresh, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
		chown(t, filepath.Join(fresh, f), uid, gid)
	}
	args = edgeArgs(fresh, ports, "--heartbeat-timeout", "1m")
	refused("a fresh directory of root's", fresh, filepath.Join(fresh, "registry.db"), fresh)
}

// rootDir is a directory of root's, 0755, that other users can reach (a
// test's TempDir is under a 0700 one).
func rootDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "ngstone-data-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

func chown(t *testing.T, path string, uid, gid int) {
	t.Helper()
	if err := os.Chown(path, uid, gid); err != nil {
		t.Fatal(err)
	}
}

// startedInstead waits for the edge p to exit or to answer /healthz on
// admin, and reports whether it answered.
func startedInstead(t *testing.T, p *proc, admin string) bool {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.exited:
			return false
		default:
		}
		if healthcheck(t.Context(), admin, time.Second) == nil {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("the edge neither exited nor became healthy within 20s")
	return false
}
