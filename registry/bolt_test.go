package registry_test

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ngstone/ngstone/registry"
)

func openBolt(t *testing.T, path string) *registry.Bolt {
	t.Helper()
	s, err := registry.OpenBolt(path, func(registry.Binding) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestBoltSurvivesReopen: bindings, their last-heard times and the
// generation counter are what the file holds when it is opened again, and
// the next generation is above every one given before, for a released
// name too.
func TestBoltSurvivesReopen(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "registry.db")
	s := openBolt(t, path)
	a, _ := s.Bind(ctx, registry.Claim{Hostname: "a.example.com", InstanceID: "ia", TokenID: "t", SessionID: 7})
	b, _ := s.Bind(ctx, registry.Claim{Hostname: "b.example.com", InstanceID: "ib", SessionID: 9})
	if ok, err := s.Release(ctx, "b.example.com", 9, b.Binding.Generation); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	heard := time.Now().Add(time.Minute).Truncate(time.Millisecond)
	if err := s.Heard([]registry.HeardAt{{Hostname: "a.example.com", Generation: a.Binding.Generation, At: heard}, {Hostname: "b.example.com", Generation: 2, At: heard}}); err != nil {
		t.Fatal(err)
	}
	s.Close()

	s = openBolt(t, path)
	defer s.Close()
	list, _ := s.List(ctx)
	if len(list) != 1 || list[0].Hostname != "a.example.com" || list[0].InstanceID != "ia" || list[0].TokenID != "t" ||
		list[0].SessionID != 7 || list[0].Generation != a.Binding.Generation || !list[0].LastHeard.Equal(heard) {
		t.Fatalf("after reopening: %+v", list)
	}
	if n := s.LastSession(); n != 7 {
		t.Errorf("LastSession %d, want 7", n)
	}
	c, err := s.Bind(ctx, registry.Claim{Hostname: "b.example.com", InstanceID: "ic", SessionID: 11})
	if err != nil || c.Binding.Generation <= b.Binding.Generation {
		t.Fatalf("bind after reopening: generation %d (%v), want above %d", c.Binding.Generation, err, b.Binding.Generation)
	}
}

// TestBoltRefusesWhatIsNotARegistry: a damaged file, another program's
// bbolt file or one of another format stops the open with an error naming
// the file, and the file is left as it was.
func TestBoltRefusesWhatIsNotARegistry(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := filepath.Join(dir, "good.db")
	s := openBolt(t, good)
	s.Bind(context.Background(), registry.Claim{Hostname: "a.example.com", InstanceID: "ia", SessionID: 1})
	s.Close()
	goodBytes, _ := os.ReadFile(good)
	damaged := append([]byte(nil), goodBytes...)
	pageSize := os.Getpagesize()
	for p := 2; p*pageSize < len(damaged); p++ { // every page but the two meta pages
		copy(damaged[p*pageSize:], bytes.Repeat([]byte{0xa5}, 64))
	}

	foreign := filepath.Join(dir, "foreign.db")
	db, err := bolt.Open(foreign, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	db.Update(func(tx *bolt.Tx) error {
		b, _ := tx.CreateBucket([]byte("somebody-else"))
		return b.Put([]byte("k"), []byte("v"))
	})
	db.Close()

	for name, path := range map[string]string{
		"text":       write("text.db", []byte("not a database at all\n")),
		"zeros":      write("zeros.db", make([]byte, 16<<10)),
		"damaged":    write("damaged.db", damaged),
		"other data": foreign,
	} {
		before, _ := os.ReadFile(path)
		_, err := registry.OpenBolt(path, nil)
		if !errors.Is(err, registry.ErrNotRegistry) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: open = %v, want ErrNotRegistry naming %s", name, err, path)
		}
		if after, _ := os.ReadFile(path); !bytes.Equal(before, after) {
			t.Errorf("%s: the file was changed", name)
		}
	}
}

// TestBoltTornMetaInvisible: a write torn in the middle of its commit (the
// newest of bbolt's two meta pages half written) is invisible: the file
// opens at the transaction before it.
func TestBoltTornMetaInvisible(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "registry.db")
	s := openBolt(t, path)
	s.Bind(ctx, registry.Claim{Hostname: "a.example.com", InstanceID: "ia", SessionID: 1})
	before, _ := os.ReadFile(path)
	s.Bind(ctx, registry.Claim{Hostname: "b.example.com", InstanceID: "ib", SessionID: 2})
	s.Close()
	after, _ := os.ReadFile(path)
	// The commit of the second bind wrote one of the two meta pages: tear it.
	pageSize := os.Getpagesize()
	for m := range 2 {
		page := after[m*pageSize : (m+1)*pageSize]
		if !bytes.Equal(page, before[m*pageSize:(m+1)*pageSize]) {
			copy(page[16:], bytes.Repeat([]byte{0}, 48))
		}
	}
	if err := os.WriteFile(path, after, 0o600); err != nil {
		t.Fatal(err)
	}
	s = openBolt(t, path)
	defer s.Close()
	list, _ := s.List(ctx)
	if len(list) != 1 || list[0].Hostname != "a.example.com" {
		t.Fatalf("after a torn commit: %+v, want the binding before it alone", list)
	}
	c, _ := s.Bind(ctx, registry.Claim{Hostname: "c.example.com", InstanceID: "ic", SessionID: 3})
	if c.Binding.Generation != 2 {
		t.Errorf("generation after the torn commit %d, want 2 (the torn one was never acknowledged)", c.Binding.Generation)
	}
}

// TestBoltHeldByAnother: a second process (here, a second open) on the
// same file is refused with a sentence, not left waiting.
func TestBoltHeldByAnother(t *testing.T) {
	path := filepath.Join(t.TempDir(), "registry.db")
	s := openBolt(t, path)
	defer s.Close()
	start := time.Now()
	_, err := registry.OpenBolt(path, nil)
	if err == nil || !strings.Contains(err.Error(), "another process") || time.Since(start) > 10*time.Second {
		t.Fatalf("second open: %v after %s", err, time.Since(start))
	}
}

// TestBoltRefusesWhatItMayNotWrite: a registry the edge may not open for
// writing (a read-only file, or no file and a directory it may not write)
// stops the open with a permission error naming the file and saying what
// to do, never ErrNotRegistry, whose advice (move it away) would forget
// every owner of a valid one; the file is left as it was.
func TestBoltRefusesWhatItMayNotWrite(t *testing.T) {
	valid := filepath.Join(t.TempDir(), "registry.db")
	s := openBolt(t, valid)
	s.Bind(context.Background(), registry.Claim{Hostname: "a.example.com", InstanceID: "ia", SessionID: 1})
	s.Close()
	before, _ := os.ReadFile(valid)
	readOnly(t, valid)
	dir := t.TempDir()
	readOnly(t, dir)
	for name, c := range map[string]struct{ path, hint string }{
		"a read-only registry":           {valid, "chown"},
		"none, in a read-only directory": {filepath.Join(dir, "registry.db"), dir},
	} {
		_, err := registry.OpenBolt(c.path, nil)
		switch {
		case err == nil:
			t.Errorf("%s: opened", name)
		case errors.Is(err, registry.ErrNotRegistry) || strings.Contains(err.Error(), "move it away"):
			t.Errorf("%s: %v, want a permission error, not a foreign file", name, err)
		case !errors.Is(err, fs.ErrPermission) || !strings.Contains(err.Error(), c.path) || !strings.Contains(err.Error(), c.hint):
			t.Errorf("%s: %v, want fs.ErrPermission naming %s and %q", name, err, c.path, c.hint)
		}
	}
	if after, _ := os.ReadFile(valid); !bytes.Equal(after, before) {
		t.Error("the read-only registry was changed")
	}
}

// readOnly makes path read-only to this process until the test ends: by
// its mode, or for root, which modes do not stop, by the immutable flag.
func readOnly(t *testing.T, path string) {
	t.Helper()
	if os.Geteuid() != 0 {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(path, st.Mode().Perm()&0o555); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod(path, st.Mode().Perm()) })
		return
	}
	if out, err := exec.Command("chattr", "+i", path).CombinedOutput(); err != nil {
		t.Skipf("root, and no immutable flag for %s (chattr: %v %s)", path, err, out)
	}
	t.Cleanup(func() { exec.Command("chattr", "-i", path).Run() })
}

// BenchmarkBind measures one bind (a takeover by the same instance, as a
// reconnect makes) in each single-edge store: the Bolt one is a durable
// write.
func BenchmarkBind(b *testing.B) {
	ctx := context.Background()
	for _, name := range []string{"memory", "bolt"} {
		b.Run(name, func(b *testing.B) {
			var s registry.Store = registry.NewMemory(nil)
			if name == "bolt" {
				bs, err := registry.OpenBolt(filepath.Join(b.TempDir(), "registry.db"), nil)
				if err != nil {
					b.Fatal(err)
				}
				defer bs.Close()
				s = bs
			}
			for i := range b.N {
				if _, err := s.Bind(ctx, registry.Claim{Hostname: "app.example.com", InstanceID: "i", SessionID: uint64(i + 1)}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
