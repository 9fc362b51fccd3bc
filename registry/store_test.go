package registry_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ngstone/ngstone/registry"
)

// newStoreFunc builds an empty Store whose holders' liveness follows l.
// Every Store implementation runs testStore through one of these.
type newStoreFunc func(t *testing.T, l *liveness) registry.Store

func TestMemory(t *testing.T) {
	testStore(t, func(t *testing.T, l *liveness) registry.Store {
		return registry.NewMemory(l.live)
	})
}

func TestBolt(t *testing.T) {
	testStore(t, func(t *testing.T, l *liveness) registry.Store {
		s, err := registry.OpenBolt(filepath.Join(t.TempDir(), "registry.db"), l.live)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	})
}

// testStore runs the Store contract against the stores newStore makes.
func testStore(t *testing.T, newStore newStoreFunc) {
	tests := map[string]func(*testing.T, newStoreFunc){
		"Created":                          testCreated,
		"Rule1SameInstanceLiveHolder":      testRule1LiveHolder,
		"Rule1BeforeLiveness":              testRule1BeforeLiveness,
		"Rule1OtherTokenIsOtherInstance":   testRule1OtherToken,
		"EmptyInstanceIDNeverMatches":      testEmptyInstanceID,
		"Rule2DeadHolder":                  testRule2DeadHolder,
		"Rule3LiveHolderRefused":           testRule3LiveHolder,
		"ExclusiveRefusesAnyHolder":        testExclusive,
		"UnchangedOnRebindBySameSession":   testUnchanged,
		"SameSessionIDOnAnotherNode":       testOtherNode,
		"GenerationsStrictlyIncrease":      testGenerations,
		"ReleaseIsCompareAndDelete":        testRelease,
		"ListSortedByHostname":             testList,
		"EmptyHostnameRefused":             testEmptyHostname,
		"SameInstanceRaceEndsWithLaterOne": testSameInstanceRace,
		"ReleaseRaceReportsOneDeletion":    testReleaseRace,
		"RandomizedConcurrency":            testRandomized,
	}
	for name, fn := range tests {
		t.Run(name, func(t *testing.T) { fn(t, newStore) })
	}
}

// liveness is what the test steers: sessions are live unless marked dead.
// The in-memory store asks it (a LivenessFunc) and it counts those calls;
// a store that keeps liveness itself is told of each change through hook.
type liveness struct {
	mu    sync.Mutex
	dead  map[uint64]bool
	calls int
	// hook, when set, is told every change (the etcd store's sessions).
	hook func(session uint64, alive bool)
	// uncounted: the store never calls live, so calls proves nothing.
	uncounted bool
}

func newLiveness() *liveness { return &liveness{dead: make(map[uint64]bool)} }

func (l *liveness) live(b registry.Binding) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls++
	return !l.dead[b.SessionID]
}

func (l *liveness) set(session uint64, alive bool) {
	l.mu.Lock()
	l.dead[session] = !alive
	hook := l.hook
	l.mu.Unlock()
	if hook != nil {
		hook(session, alive)
	}
}

func (l *liveness) isDead(session uint64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dead[session]
}

func (l *liveness) callCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls
}

const (
	host  = "app.example.com"
	instA = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	instB = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

func claim(inst string, session uint64) registry.Claim {
	return registry.Claim{Hostname: host, InstanceID: inst, TokenID: "tok", SessionID: session}
}

func mustBind(t *testing.T, s registry.Store, c registry.Claim, want registry.Outcome) registry.Result {
	t.Helper()
	res, err := s.Bind(context.Background(), c)
	if err != nil {
		t.Fatalf("Bind(%+v): %v", c, err)
	}
	if res.Outcome != want {
		t.Fatalf("Bind(%+v): outcome %s, want %s", c, res.Outcome, want)
	}
	b := res.Binding
	if b.Hostname != c.Hostname || b.InstanceID != c.InstanceID || b.TokenID != c.TokenID ||
		b.SessionID != c.SessionID || b.Node != c.Node || b.Generation == 0 || b.BoundAt.IsZero() {
		t.Fatalf("Bind(%+v): binding %+v does not match the claim", c, b)
	}
	return res
}

func mustRefuse(t *testing.T, s registry.Store, c registry.Claim) {
	t.Helper()
	before, held := get(t, s, c.Hostname)
	if res, err := s.Bind(context.Background(), c); !errors.Is(err, registry.ErrTaken) {
		t.Fatalf("Bind(%+v) = %+v, %v; want ErrTaken", c, res, err)
	}
	after, still := get(t, s, c.Hostname)
	if held != still || !reflect.DeepEqual(before, after) {
		t.Fatalf("a refused bind changed the binding from %+v to %+v", before, after)
	}
}

func get(t *testing.T, s registry.Store, hostname string) (registry.Binding, bool) {
	t.Helper()
	b, ok, err := s.Get(context.Background(), hostname)
	if err != nil {
		t.Fatalf("Get(%s): %v", hostname, err)
	}
	return b, ok
}

func mustOwn(t *testing.T, s registry.Store, want registry.Binding) {
	t.Helper()
	got, ok := get(t, s, want.Hostname)
	if !ok || !reflect.DeepEqual(got, want) {
		t.Fatalf("Get(%s) = %+v, %v; want %+v", want.Hostname, got, ok, want)
	}
}

func mustPrevious(t *testing.T, res registry.Result, want registry.Binding) {
	t.Helper()
	if res.Previous == nil || !reflect.DeepEqual(*res.Previous, want) {
		t.Fatalf("Previous = %+v, want %+v", res.Previous, want)
	}
	if res.Binding.Generation <= want.Generation {
		t.Fatalf("takeover generation %d is not above the previous %d", res.Binding.Generation, want.Generation)
	}
}

func testCreated(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	if _, ok := get(t, s, host); ok {
		t.Fatal("an empty store holds a binding")
	}
	res := mustBind(t, s, claim(instA, 1), registry.Created)
	if res.Previous != nil {
		t.Fatalf("Previous = %+v on a fresh hostname", res.Previous)
	}
	mustOwn(t, s, res.Binding)
}

func testRule1LiveHolder(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	second := mustBind(t, s, claim(instA, 2), registry.SameInstance)
	mustPrevious(t, second, first.Binding)
	mustOwn(t, s, second.Binding)
}

// testRule1BeforeLiveness checks that rule 1 wins even over a dead holder
// (the outcome is SameInstance, not DeadHolder) and that liveness is not
// consulted for it.
func testRule1BeforeLiveness(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	l.set(1, false)
	calls := l.callCount()
	second := mustBind(t, s, claim(instA, 2), registry.SameInstance)
	mustPrevious(t, second, first.Binding)
	if n := l.callCount() - calls; n != 0 {
		t.Fatalf("liveness was consulted %d times for a rule-1 takeover", n)
	}
}

func testRule1OtherToken(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	other := claim(instA, 2)
	other.TokenID = "another-token"
	mustRefuse(t, s, other) // live holder: rule 3
	l.set(1, false)
	res := mustBind(t, s, other, registry.DeadHolder) // dead holder: rule 2
	mustPrevious(t, res, first.Binding)
}

func testEmptyInstanceID(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	mustBind(t, s, claim("", 1), registry.Created)
	mustRefuse(t, s, claim("", 2))
}

func testRule2DeadHolder(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	l.set(1, false)
	res := mustBind(t, s, claim(instB, 2), registry.DeadHolder)
	mustPrevious(t, res, first.Binding)
	mustOwn(t, s, res.Binding)
}

func testRule3LiveHolder(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	calls := l.callCount()
	mustRefuse(t, s, claim(instB, 2))
	if !l.uncounted && l.callCount() == calls {
		t.Fatal("rule 3 refused without consulting liveness")
	}
	mustOwn(t, s, first.Binding)
}

func testExclusive(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	l.set(1, false)
	for name, c := range map[string]registry.Claim{
		"other instance, dead holder": claim(instB, 2),
		"same instance":               claim(instA, 3),
		"same session":                claim(instA, 1),
	} {
		c.Exclusive = true
		t.Run(name, func(t *testing.T) { mustRefuse(t, s, c) })
	}
	mustOwn(t, s, first.Binding)
	free := claim(instB, 2)
	free.Hostname, free.Exclusive = "free.example.com", true
	mustBind(t, s, free, registry.Created)
}

func testUnchanged(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	first := mustBind(t, s, claim(instA, 1), registry.Created)
	again, err := s.Bind(context.Background(), claim(instA, 1))
	if err != nil || again.Outcome != registry.Unchanged || !reflect.DeepEqual(again.Binding, first.Binding) || again.Previous != nil {
		t.Fatalf("re-bind by the same session = %+v, %v; want Unchanged with %+v", again, err, first.Binding)
	}
	mustOwn(t, s, first.Binding)
}

func testOtherNode(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	c := claim(instA, 1)
	c.Node = "edge-1"
	first := mustBind(t, s, c, registry.Created)
	c.Node = "edge-2"
	res := mustBind(t, s, c, registry.SameInstance)
	mustPrevious(t, res, first.Binding)
}

func testGenerations(t *testing.T, newStore newStoreFunc) {
	l := newLiveness()
	s := newStore(t, l)
	ctx := context.Background()
	var last uint64
	step := func(what string, gen uint64) {
		t.Helper()
		if gen <= last {
			t.Fatalf("%s: generation %d is not above %d", what, gen, last)
		}
		last = gen
	}
	b := mustBind(t, s, claim(instA, 1), registry.Created).Binding
	step("bind", b.Generation)
	b = mustBind(t, s, claim(instA, 2), registry.SameInstance).Binding
	step("same-instance takeover", b.Generation)
	l.set(2, false)
	b = mustBind(t, s, claim(instB, 3), registry.DeadHolder).Binding
	step("dead-holder takeover", b.Generation)
	if ok, err := s.Release(ctx, host, 3, b.Generation); !ok || err != nil {
		t.Fatalf("Release by the owner = %v, %v", ok, err)
	}
	b = mustBind(t, s, claim(instB, 3), registry.Created).Binding
	step("re-bind after release by the same session", b.Generation)
	// Activity on another hostname does not disturb this one's order.
	other := claim(instA, 4)
	other.Hostname = "other.example.com"
	mustBind(t, s, other, registry.Created)
	s.Release(ctx, host, 3, b.Generation)
	b = mustBind(t, s, claim(instA, 5), registry.Created).Binding
	step("bind after another hostname's bind", b.Generation)
}

func testRelease(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	ctx := context.Background()
	release := func(hostname string, session, gen uint64, want bool) {
		t.Helper()
		ok, err := s.Release(ctx, hostname, session, gen)
		if err != nil || ok != want {
			t.Fatalf("Release(%s, session %d, gen %d) = %v, %v; want %v", hostname, session, gen, ok, err, want)
		}
	}
	release(host, 1, 1, false) // nothing bound
	old := mustBind(t, s, claim(instA, 1), registry.Created).Binding
	cur := mustBind(t, s, claim(instA, 2), registry.SameInstance).Binding
	release(host, old.SessionID, old.Generation, false)   // the evicted session's late cleanup
	release(host, old.SessionID, cur.Generation, false)   // wrong session, current generation
	release(host, cur.SessionID, old.Generation, false)   // owner, older generation
	release(host, cur.SessionID, cur.Generation+1, false) // owner, a generation not yet granted
	release("other.example.com", cur.SessionID, cur.Generation, false)
	mustOwn(t, s, cur)
	release(host, cur.SessionID, cur.Generation, true)
	release(host, cur.SessionID, cur.Generation, false) // idempotent
	if b, ok := get(t, s, host); ok {
		t.Fatalf("released hostname still bound to %+v", b)
	}
	// Same session, released then bound again: its older generation is stale.
	again := mustBind(t, s, claim(instA, 2), registry.Created).Binding
	release(host, 2, cur.Generation, false)
	mustOwn(t, s, again)
}

func testList(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	ctx := context.Background()
	if l, err := s.List(ctx); err != nil || len(l) != 0 {
		t.Fatalf("List of an empty store = %v, %v", l, err)
	}
	want := []string{"a.example.com", "b.example.com", "c.example.com"}
	for i, h := range []string{want[2], want[0], want[1]} {
		c := claim(instA, uint64(i+1))
		c.Hostname = h
		mustBind(t, s, c, registry.Created)
	}
	l, err := s.List(ctx)
	if err != nil || len(l) != len(want) {
		t.Fatalf("List = %v, %v", l, err)
	}
	for i, b := range l {
		if b.Hostname != want[i] {
			t.Fatalf("List[%d] = %s, want %s", i, b.Hostname, want[i])
		}
		mustOwn(t, s, b)
	}
}

func testEmptyHostname(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	c := claim(instA, 1)
	c.Hostname = ""
	if res, err := s.Bind(context.Background(), c); err == nil {
		t.Fatalf("Bind of an empty hostname = %+v", res)
	}
}

// testSameInstanceRace binds one instance from two sessions at once, many
// times: both binds succeed (never ErrTaken, though both holders are live)
// and the owner at the end is the later bind, the one with the higher
// generation, whose Previous is the earlier.
func testSameInstanceRace(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	const rounds = 200
	for r := range rounds {
		hostname := fmt.Sprintf("race%d.example.com", r)
		var results [2]registry.Result
		var errs [2]error
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := claim(instA, uint64(2*r+i+1))
				c.Hostname = hostname
				<-start
				results[i], errs[i] = s.Bind(context.Background(), c)
			}()
		}
		close(start)
		wg.Wait()
		if errs[0] != nil || errs[1] != nil {
			t.Fatalf("round %d: binds failed: %v, %v", r, errs[0], errs[1])
		}
		early, late := results[0], results[1]
		if late.Binding.Generation < early.Binding.Generation {
			early, late = late, early
		}
		if early.Outcome != registry.Created || late.Outcome != registry.SameInstance {
			t.Fatalf("round %d: outcomes %s then %s, want created then same_instance", r, early.Outcome, late.Outcome)
		}
		mustPrevious(t, late, early.Binding)
		mustOwn(t, s, late.Binding)
	}
}

// testReleaseRace releases one binding from several callers at once (a
// session's cleanup beside a bind that found its session closed): exactly
// one of them reports the deletion, however the store settles the race.
func testReleaseRace(t *testing.T, newStore newStoreFunc) {
	s := newStore(t, newLiveness())
	const rounds, callers = 50, 3
	for r := range rounds {
		c := claim(instA, uint64(r+1))
		c.Hostname = fmt.Sprintf("release%d.example.com", r)
		b := mustBind(t, s, c, registry.Created).Binding
		var deleted atomic.Int32
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range callers {
			wg.Go(func() {
				<-start
				ok, err := s.Release(context.Background(), b.Hostname, b.SessionID, b.Generation)
				if err != nil {
					t.Errorf("round %d: Release: %v", r, err)
				}
				if ok {
					deleted.Add(1)
				}
			})
		}
		close(start)
		wg.Wait()
		if n := deleted.Load(); n != 1 {
			t.Fatalf("round %d: %d of %d concurrent Releases of %s at generation %d reported the deletion, want 1", r, n, callers, b.Hostname, b.Generation)
		}
		if got, ok := get(t, s, b.Hostname); ok {
			t.Fatalf("round %d: released hostname still bound to %+v", r, got)
		}
	}
}
