package registry_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ngstone/ngstone/registry"
)

// Every store, each with the pool's rules: the cluster's too, its claims
// through the store of their node.
var poolStores = map[string]newStoreFunc{
	"Etcd":   func(t *testing.T, l *liveness) registry.Store { return newEtcdNodes(t, l) },
	"Memory": func(t *testing.T, l *liveness) registry.Store { return registry.NewMemory(l.live) },
	"Bolt": func(t *testing.T, l *liveness) registry.Store {
		s, err := registry.OpenBolt(filepath.Join(t.TempDir(), "registry.db"), l.live)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	},
}

const instC = "cccccccccccccccccccccccccccccccc"

func poolClaim(inst string, session uint64) registry.Claim {
	c := claim(inst, session)
	c.Pool = true
	return c
}

// members returns the sessions of hostname's owners, in order.
func members(t *testing.T, s registry.Store) []uint64 {
	t.Helper()
	b, ok := get(t, s, host)
	if !ok {
		return nil
	}
	var out []uint64
	for _, m := range b.Owners() {
		out = append(out, m.SessionID)
	}
	return out
}

func TestPool(t *testing.T) {
	for name, newStore := range poolStores {
		t.Run(name, func(t *testing.T) {
			t.Run("JoinReplaceRelease", func(t *testing.T) { testPoolJoin(t, newStore) })
			t.Run("RuleThreeBothWays", func(t *testing.T) { testPoolRuleThree(t, newStore) })
			t.Run("DeadPoolTakenOver", func(t *testing.T) { testPoolDead(t, newStore) })
		})
	}
}

// Members join one by one, each an owner of its own: rule 1 replaces only
// its own member, release removes only its own, and the name is free when
// the last one leaves.
func testPoolJoin(t *testing.T, newStore newStoreFunc) {
	ctx := context.Background()
	s := newStore(t, newLiveness())
	a := mustBind(t, s, poolClaim(instA, 1), registry.Created)
	b := mustBind(t, s, poolClaim(instB, 2), registry.Joined)
	c := mustBind(t, s, poolClaim(instC, 3), registry.Joined)
	if a.Binding.Pool || b.Binding.SessionID != 2 || c.Binding.Generation <= b.Binding.Generation {
		t.Fatalf("grants %+v %+v %+v: each a member, generations rising", a.Binding, b.Binding, c.Binding)
	}
	mustBind(t, s, poolClaim(instB, 2), registry.Unchanged)
	if got := members(t, s); len(got) != 3 {
		t.Fatalf("members %v, want 3", got)
	}
	// B's agent reconnects: its own member only is replaced.
	b2 := mustBind(t, s, poolClaim(instB, 4), registry.SameInstance)
	mustPrevious(t, b2, b.Binding)
	// In place on one edge; in the order of generations in the cluster.
	if got := members(t, s); !slices.Equal(got, []uint64{1, 4, 3}) && !slices.Equal(got, []uint64{1, 3, 4}) {
		t.Fatalf("after B's takeover members %v, want 1, 3 and 4", got)
	}
	// The old B session's late release removes nothing.
	if ok, err := s.Release(ctx, host, 2, b.Binding.Generation); ok || err != nil {
		t.Fatalf("late release of a replaced member: %v %v", ok, err)
	}
	for _, r := range []registry.Result{a, b2} {
		if ok, err := s.Release(ctx, host, r.Binding.SessionID, r.Binding.Generation); !ok || err != nil {
			t.Fatalf("release of member %d: %v %v", r.Binding.SessionID, ok, err)
		}
	}
	if got := members(t, s); len(got) != 1 || got[0] != 3 {
		t.Fatalf("members %v, want [3]", got)
	}
	if ok, _ := s.Release(ctx, host, 3, c.Binding.Generation); !ok {
		t.Fatal("the last member's release failed")
	}
	if _, held := get(t, s, host); held {
		t.Fatal("the name is still bound after its last member left")
	}
	// Free again: a bind without Pool takes it as before.
	mustBind(t, s, claim(instA, 5), registry.Created)
}

// A pool is joined only by a claim with Pool and the pool's token; a live
// holder without Pool is never joined.
func testPoolRuleThree(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	mustBind(t, s, claim(instA, 1), registry.Created)
	if _, err := s.Bind(context.Background(), poolClaim(instB, 2)); !errors.Is(err, registry.ErrNotPooled) || !errors.Is(err, registry.ErrTaken) {
		t.Fatalf("pool claim against a live single holder: %v, want ErrNotPooled (ErrTaken)", err)
	}
	mustRefuse(t, s, poolClaim(instB, 2))

	s = newStore(t, newLiveness())
	mustBind(t, s, poolClaim(instA, 1), registry.Created)
	if _, err := s.Bind(context.Background(), claim(instB, 2)); !errors.Is(err, registry.ErrPooled) {
		t.Fatalf("claim without Pool against a live pool: %v, want ErrPooled", err)
	}
	mustRefuse(t, s, claim(instB, 2))
	other := poolClaim(instB, 3)
	other.TokenID = "another"
	mustRefuse(t, s, other)
	tls := poolClaim(instB, 4)
	tls.Proto = "tls"
	mustRefuse(t, s, tls)
	excl := poolClaim(instB, 5)
	excl.Exclusive = true
	mustRefuse(t, s, excl)
	if got := members(t, s); len(got) != 1 {
		t.Fatalf("refused claims changed the pool: %v", got)
	}
}

// A pool whose every member is dead is taken over whole (rule 2), by a
// claim with or without Pool; one live member keeps it.
func testPoolDead(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	a := mustBind(t, s, poolClaim(instA, 1), registry.Created)
	mustBind(t, s, poolClaim(instB, 2), registry.Joined)
	l.set(1, false)
	other := claim(instC, 3)
	other.TokenID = "another"
	mustRefuse(t, s, other)
	l.set(2, false)
	res := mustBind(t, s, other, registry.DeadHolder)
	if res.Previous == nil || !res.Previous.Pool || len(res.Previous.Owners()) != 2 || res.Previous.Members[0].SessionID != a.Binding.SessionID {
		t.Fatalf("Previous %+v, want the pool of both dead members", res.Previous)
	}
	mustOwn(t, s, res.Binding)
}

// A pool's members are in the file when it is opened again.
func TestBoltPoolSurvivesReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "registry.db")
	s, err := registry.OpenBolt(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	mustBind(t, s, poolClaim(instA, 1), registry.Created)
	b := mustBind(t, s, poolClaim(instB, 2), registry.Joined)
	s.Close()
	s, err = registry.OpenBolt(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if got := members(t, s); len(got) != 2 || got[1] != 2 {
		t.Fatalf("members after reopening %v, want [1 2]", got)
	}
	if n := s.LastSession(); n != 2 {
		t.Fatalf("LastSession %d, want 2 (a member's)", n)
	}
	if ok, _ := s.Release(context.Background(), host, 2, b.Binding.Generation); !ok {
		t.Fatal("release of a member after reopening failed")
	}
}

// A pool takes MaxPoolMembers members and no more; a member's own
// instance still takes its place back in a full pool.
func TestPoolFull(t *testing.T) {
	for name, newStore := range poolStores {
		t.Run(name, func(t *testing.T) {
			s := newStore(t, newLiveness())
			var first registry.Result
			for i := range registry.MaxPoolMembers {
				c := poolClaim(fmt.Sprintf("%032x", i), uint64(i+1))
				res, err := s.Bind(context.Background(), c)
				if err != nil {
					t.Fatalf("member %d: %v", i, err)
				}
				if i == 0 {
					first = res
				}
			}
			over := poolClaim(fmt.Sprintf("%032x", registry.MaxPoolMembers), 1000)
			if _, err := s.Bind(context.Background(), over); !errors.Is(err, registry.ErrPoolFull) || !errors.Is(err, registry.ErrTaken) {
				t.Fatalf("member %d: %v, want ErrPoolFull (ErrTaken)", registry.MaxPoolMembers+1, err)
			}
			back := mustBind(t, s, poolClaim(fmt.Sprintf("%032x", 0), 1001), registry.SameInstance)
			mustPrevious(t, back, first.Binding)
			if got := members(t, s); len(got) != registry.MaxPoolMembers {
				t.Fatalf("%d members, want %d", len(got), registry.MaxPoolMembers)
			}
		})
	}
}
