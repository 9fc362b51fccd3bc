package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/ngstone/ngstone/mux"
)

// A named tunnel's instance id can outlive its agent process. The edge
// gives a name back at once only to the instance that held it (DESIGN.md's
// first binding rule); a restarted process is a new instance, refused while
// its predecessor still looks alive to the edge. That predecessor is often
// the same user's agent, killed or restarted after its network dropped,
// whose connection the edge will only declare dead after the heartbeat
// timeout. KeepInstance lets the next process on this machine be that same
// instance, as long as no running process still is.

// errLocked: another running process holds the instance file.
var errLocked = errors.New("instance file locked by a running agent")

// KeepInstance returns the instance id kept in dir for cfg's edge, token
// and the names its tunnels ask for (the set of them, for several),
// creating it on the first run, and a release function. Until release is
// called, or the process ends, this process holds the id: another that
// asks for it meanwhile gets a new id of its own, which is not kept, so two
// running agents are never one instance. kept reports an id from an
// earlier run. Without a name asked for there is nothing to take back, and
// it returns an error.
func KeepInstance(dir string, cfg Config) (id string, kept bool, release func(), err error) {
	names := keptNames(cfg)
	if names == "" {
		return "", false, nil, errors.New("keep instance: no subdomain")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", false, nil, err
	}
	sum := sha256.Sum256([]byte(cfg.Edge + "\x00" + names + "\x00" + cfg.Token))
	f, err := os.OpenFile(filepath.Join(dir, hex.EncodeToString(sum[:12])), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return "", false, nil, err
	}
	if err := lockFile(f); err != nil {
		f.Close()
		if errors.Is(err, errLocked) {
			return NewInstanceID(), false, func() {}, nil
		}
		return "", false, nil, err
	}
	release = func() { f.Close() } // closing the file drops the lock
	b, err := io.ReadAll(io.LimitReader(f, 64))
	if err != nil {
		release()
		return "", false, nil, err
	}
	if id := strings.TrimSpace(string(b)); mux.ValidInstanceID(id) {
		return id, true, release, nil
	}
	id = NewInstanceID()
	if err := rewrite(f, id+"\n"); err != nil {
		release()
		return "", false, nil, fmt.Errorf("write %s: %w", f.Name(), err)
	}
	return id, false, release, nil
}

func rewrite(f *os.File, s string) error {
	if err := f.Truncate(0); err != nil {
		return err
	}
	if _, err := f.WriteAt([]byte(s), 0); err != nil {
		return err
	}
	return f.Sync()
}

// keptNames is the names cfg's tunnels ask for, sorted, as one key; a
// random name is not one to take back. One tunnel's key is what it was
// before agents had several, so an upgraded agent keeps its instance.
func keptNames(cfg Config) string {
	var names []string
	for _, t := range cfg.tunnels() {
		switch {
		case t.isTCP():
			names = append(names, "tcp "+t.label())
		case t.Hostname != "":
			names = append(names, "hostname "+t.Hostname)
		case t.Subdomain != "":
			names = append(names, t.Subdomain)
		}
	}
	slices.Sort(names)
	return strings.Join(names, "\x00")
}
