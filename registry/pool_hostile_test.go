package registry_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/registry"
)

// Attacks on a pool in the registry: claims that must never join or take
// a member, releases that must remove nothing, and members that join and
// leave all at once.
func TestPoolHostile(t *testing.T) {
	for name, newStore := range poolStores {
		t.Run(name, func(t *testing.T) {
			t.Run("Claims", func(t *testing.T) { testPoolHostileClaims(t, newStore) })
			t.Run("JoinReleaseRace", func(t *testing.T) { testPoolJoinReleaseRace(t, newStore) })
		})
	}
}

func testPoolHostileClaims(t *testing.T, newStore newStoreFunc) {
	ctx := context.Background()
	l := newLiveness()
	s := newStore(t, l)
	a := mustBind(t, s, poolClaim(instA, 1), registry.Created)
	b := mustBind(t, s, poolClaim(instB, 2), registry.Joined)
	pool, _ := get(t, s, host)

	// Another token with a member's instance id: not that instance.
	stolen := poolClaim(instA, 3)
	stolen.TokenID = "another"
	mustRefuse(t, s, stolen)
	stolen.Pool = false
	mustRefuse(t, s, stolen)
	// Nor once the other member is dead, the member it poses as live.
	l.set(2, false)
	stolen.Pool = true
	mustRefuse(t, s, stolen)
	stolen.Pool = false
	mustRefuse(t, s, stolen)

	// An exclusive claim (a random name) takes nothing, a pool whose
	// every member is dead neither, with Pool or without.
	l.set(1, false)
	for _, pooled := range []bool{true, false} {
		excl := claim(instC, 4)
		excl.Pool, excl.Exclusive = pooled, true
		mustRefuse(t, s, excl)
	}
	l.set(1, true)
	l.set(2, true)

	// Releases by the wrong session or generation remove nothing: one
	// member's session with the other's generation, an unknown session,
	// the pool's own generation under another session.
	for _, r := range []struct{ session, gen uint64 }{
		{1, b.Binding.Generation}, {2, a.Binding.Generation}, {99, a.Binding.Generation},
		{3, pool.Generation}, {1, 0}, {0, a.Binding.Generation},
	} {
		if ok, err := s.Release(ctx, host, r.session, r.gen); ok || err != nil {
			t.Fatalf("Release(session %d, generation %d) = %v, %v; want nothing removed", r.session, r.gen, ok, err)
		}
	}
	mustOwn(t, s, pool)
	// A member binding again from its own session changes nothing.
	mustBind(t, s, poolClaim(instA, 1), registry.Unchanged)
	mustOwn(t, s, pool)
}

// Eight agents join and leave one pool, forty times each, all at once,
// while another reads it: each join is granted (each is another
// instance), each release removes its own member, the pool never holds a
// session or an instance twice and says its newest generation, every
// generation is new, and at the end the name is free.
func testPoolJoinReleaseRace(t *testing.T, newStore newStoreFunc) {
	ctx := context.Background()
	s := newStore(t, newLiveness())
	var session atomic.Uint64
	var gens sync.Map
	done := make(chan struct{})
	var reader sync.WaitGroup
	reader.Go(func() {
		for range 100000 {
			select {
			case <-done:
				return
			default:
			}
			b, ok, err := s.Get(ctx, host)
			if err != nil {
				t.Errorf("Get: %v", err)
				return
			}
			if !ok {
				continue
			}
			if err := poolSane(b); err != nil {
				t.Errorf("pool %+v: %v", b, err)
				return
			}
		}
	})
	var wg sync.WaitGroup
	for g := range 8 {
		inst := fmt.Sprintf("%032x", g+1)
		wg.Go(func() {
			for range 40 {
				c := poolClaim(inst, session.Add(1))
				res, err := s.Bind(ctx, c)
				if err != nil || res.Outcome != registry.Created && res.Outcome != registry.Joined {
					t.Errorf("Bind(%+v) = %+v, %v; want created or joined", c, res, err)
					return
				}
				if _, dup := gens.LoadOrStore(res.Binding.Generation, true); dup {
					t.Errorf("generation %d granted twice", res.Binding.Generation)
					return
				}
				if ok, err := s.Release(ctx, host, c.SessionID, res.Binding.Generation); !ok || err != nil {
					t.Errorf("release of its own member %d: %v %v", c.SessionID, ok, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(done)
	reader.Wait()
	if b, held := get(t, s, host); held {
		t.Fatalf("every member left, but the name holds %+v", b)
	}
}

// poolSane checks what a pool's binding says of its members.
func poolSane(b registry.Binding) error {
	if !b.Pool || len(b.Members) == 0 {
		return errors.New("not a pool of members")
	}
	sessions, instances := map[uint64]bool{}, map[string]bool{}
	var newest uint64
	for _, m := range b.Members {
		if sessions[m.SessionID] || instances[m.InstanceID] {
			return fmt.Errorf("session %d or instance %s twice", m.SessionID, m.InstanceID)
		}
		sessions[m.SessionID], instances[m.InstanceID] = true, true
		if m.TokenID != b.TokenID || m.Hostname != b.Hostname {
			return fmt.Errorf("member %+v is not of the pool's token and name", m)
		}
		newest = max(newest, m.Generation)
	}
	if b.Generation != newest {
		return fmt.Errorf("generation %d, its newest member's %d", b.Generation, newest)
	}
	return nil
}

// When the holders of a pool's members were heard from is kept for each
// member, in one call, across a reopening; a time for a generation the
// pool no longer holds changes nothing.
func TestBoltPoolHeard(t *testing.T) {
	path := filepath.Join(t.TempDir(), "registry.db")
	s, err := registry.OpenBolt(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := mustBind(t, s, poolClaim(instA, 1), registry.Created)
	b := mustBind(t, s, poolClaim(instB, 2), registry.Joined)
	b2 := mustBind(t, s, poolClaim(instB, 3), registry.SameInstance) // b's generation is gone
	at := time.Now().Add(time.Minute).UTC()
	err = s.Heard([]registry.HeardAt{
		{Hostname: host, Generation: a.Binding.Generation, At: at},
		{Hostname: host, Generation: b2.Binding.Generation, At: at.Add(time.Second)},
		{Hostname: host, Generation: b.Binding.Generation, At: at.Add(time.Hour)},
		{Hostname: "other.example.com", Generation: a.Binding.Generation, At: at},
	})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	s, err = registry.OpenBolt(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, _ := get(t, s, host)
	if err := poolSane(p); err != nil || len(p.Members) != 2 {
		t.Fatalf("pool after reopening %+v: %v", p, err)
	}
	if !p.Members[0].LastHeard.Equal(at) || !p.Members[1].LastHeard.Equal(at.Add(time.Second)) {
		t.Fatalf("members heard at %v and %v, want %v and %v", p.Members[0].LastHeard, p.Members[1].LastHeard, at, at.Add(time.Second))
	}
	if _, held := get(t, s, "other.example.com"); held {
		t.Fatal("a heard time for a name nobody holds bound it")
	}
}
