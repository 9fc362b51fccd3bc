package agent

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/ngstone/ngstone/mux"
)

// TestKeepInstance: a named tunnel's instance id is kept from one run to
// the next, never shared by two running holders, and made anew when its
// file is damaged.
func TestKeepInstance(t *testing.T) {
	if runtime.GOOS == "windows" || runtime.GOOS == "plan9" {
		t.Skip("no file locks here: every run is a new instance")
	}
	dir := t.TempDir()
	cfg := Config{Edge: "edge.example:4443", Tunnel: Tunnel{Subdomain: "demo"}, Token: "secret"}
	first, kept, release, err := KeepInstance(dir, cfg)
	if err != nil || kept || !mux.ValidInstanceID(first) {
		t.Fatalf("first run: %q kept=%v %v", first, kept, err)
	}
	// A second agent while the first runs is another instance, not kept.
	other, kept, releaseOther, err := KeepInstance(dir, cfg)
	if err != nil || kept || other == first || !mux.ValidInstanceID(other) {
		t.Fatalf("while held: %q kept=%v %v (first %q)", other, kept, err, first)
	}
	releaseOther()
	release()
	// The next run is the first one's instance.
	again, kept, release, err := KeepInstance(dir, cfg)
	if err != nil || !kept || again != first {
		t.Fatalf("next run: %q kept=%v %v, want %q", again, kept, err, first)
	}
	release()

	// Another name, edge or token is another instance.
	for _, c := range []Config{
		{Edge: cfg.Edge, Tunnel: Tunnel{Subdomain: "other"}, Token: cfg.Token},
		{Edge: "edge2.example:4443", Tunnel: Tunnel{Subdomain: cfg.Subdomain}, Token: cfg.Token},
		{Edge: cfg.Edge, Tunnel: Tunnel{Subdomain: cfg.Subdomain}, Token: "another"},
	} {
		id, _, release, err := KeepInstance(dir, c)
		if err != nil || id == first {
			t.Errorf("%+v: %q %v, want an id of its own", c, id, err)
		}
		release()
	}

	// A damaged file gives a new id, kept from then on.
	files, _ := filepath.Glob(filepath.Join(dir, "*"))
	for _, f := range files {
		if err := os.WriteFile(f, []byte("not an id\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	fresh, kept, release, err := KeepInstance(dir, cfg)
	if err != nil || kept || fresh == first || !mux.ValidInstanceID(fresh) {
		t.Fatalf("damaged file: %q kept=%v %v", fresh, kept, err)
	}
	release()
	if id, kept, release, _ := KeepInstance(dir, cfg); id != fresh || !kept {
		t.Fatalf("after the damaged file: %q kept=%v, want %q kept", id, kept, fresh)
	} else {
		release()
	}

	if _, _, _, err := KeepInstance(dir, Config{Edge: cfg.Edge}); err == nil {
		t.Error("a random name has no instance to keep, but got one")
	}
}
