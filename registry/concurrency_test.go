package registry_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/registry"
)

// history is what every worker of testRandomized has seen, shared under one
// lock so that the checks can run while the store is busy.
type history struct {
	t  *testing.T
	mu sync.Mutex
	// grants holds every granted binding by hostname and generation.
	grants map[string]map[uint64]registry.Binding
	// released records the (hostname, generation) pairs a Release removed.
	released map[string]map[uint64]bool
	// maxGranted is the highest generation granted per hostname so far.
	maxGranted map[string]uint64
}

func newHistory(t *testing.T, hosts []string) *history {
	h := &history{t: t, grants: map[string]map[uint64]registry.Binding{},
		released: map[string]map[uint64]bool{}, maxGranted: map[string]uint64{}}
	for _, host := range hosts {
		h.grants[host] = map[uint64]registry.Binding{}
		h.released[host] = map[uint64]bool{}
	}
	return h
}

// granted records a grant. Two grants of one generation for a hostname
// mean generations did not strictly increase.
func (h *history) granted(b registry.Binding) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if prev, dup := h.grants[b.Hostname][b.Generation]; dup && !reflect.DeepEqual(prev, b) {
		h.t.Errorf("generation %d of %s granted twice: %+v and %+v", b.Generation, b.Hostname, prev, b)
	}
	h.grants[b.Hostname][b.Generation] = b
	h.maxGranted[b.Hostname] = max(h.maxGranted[b.Hostname], b.Generation)
}

func (h *history) max(hostname string) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.maxGranted[hostname]
}

// didRelease records a Release that reported a deletion. before is the
// highest generation granted before the Release began: a later generation
// had already replaced (hostname, gen), so deleting "it" would have deleted
// the newer owner.
func (h *history) didRelease(hostname string, session, gen, before uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if gen < before {
		h.t.Errorf("Release(%s, session %d, gen %d) deleted, but generation %d had already been granted", hostname, session, gen, before)
	}
	b, ok := h.grants[hostname][gen]
	if ok && b.SessionID != session {
		h.t.Errorf("Release(%s, session %d, gen %d) deleted a binding granted to session %d", hostname, session, gen, b.SessionID)
	}
	if h.released[hostname][gen] {
		h.t.Errorf("Release(%s, gen %d) deleted twice", hostname, gen)
	}
	h.released[hostname][gen] = true
}

// worker is one agent process: an instance that reconnects with new
// sessions, binds, releases, and sometimes dies or misses heartbeats.
type worker struct {
	store    registry.Store
	live     *liveness
	hist     *history
	hosts    []string
	rnd      *rand.Rand
	nextSess *atomic.Uint64

	instance string
	session  uint64
	held     map[string]uint64 // hostname -> generation granted to this worker
	seen     map[string]uint64 // highest generation observed per hostname
}

func (w *worker) step(t *testing.T) {
	ctx := context.Background()
	host := w.hosts[w.rnd.IntN(len(w.hosts))]
	switch op := w.rnd.IntN(10); {
	case op < 5:
		w.bind(t, ctx, host)
	case op < 7:
		w.release(ctx, host, w.session)
	case op == 7:
		w.release(ctx, host, w.nextSess.Load()) // someone else's session
	case op == 8:
		w.live.set(w.session, w.rnd.IntN(2) == 0) // a heartbeat late or back
	default:
		w.die(ctx)
	}
	w.check(t, ctx)
}

func (w *worker) bind(t *testing.T, ctx context.Context, host string) {
	c := registry.Claim{Hostname: host, InstanceID: w.instance, TokenID: "tok",
		SessionID: w.session, Exclusive: w.rnd.IntN(8) == 0}
	res, err := w.store.Bind(ctx, c)
	if errors.Is(err, registry.ErrTaken) {
		return
	}
	if err != nil {
		t.Errorf("Bind(%+v): %v", c, err)
		return
	}
	b := res.Binding
	if b.Hostname != host || b.SessionID != w.session || b.InstanceID != w.instance {
		t.Errorf("Bind(%+v) granted %+v", c, b)
	}
	if res.Outcome == registry.Unchanged {
		if b.Generation < w.seen[host] {
			t.Errorf("Unchanged bind of %s at generation %d, after %d was seen", host, b.Generation, w.seen[host])
		}
	} else if b.Generation <= w.seen[host] {
		t.Errorf("bind of %s granted generation %d, not above the %d seen before", host, b.Generation, w.seen[host])
	}
	if p := res.Previous; p != nil && (p.Hostname != host || p.Generation >= b.Generation) {
		t.Errorf("bind of %s at generation %d reports Previous %+v", host, b.Generation, p)
	}
	w.hist.granted(b)
	w.seen[host] = max(w.seen[host], b.Generation)
	w.held[host] = b.Generation
}

// release runs the edge's compare-and-delete for what this worker believes
// it holds, which may be long stale.
func (w *worker) release(ctx context.Context, host string, session uint64) {
	gen, ok := w.held[host]
	if !ok {
		gen = w.seen[host]
	}
	if gen > 1 && w.rnd.IntN(4) == 0 {
		gen = 1 + w.rnd.Uint64N(gen) // maybe an older generation of the same session
	}
	before := w.hist.max(host)
	deleted, err := w.store.Release(ctx, host, session, gen)
	if err != nil {
		w.hist.t.Errorf("Release(%s): %v", host, err)
		return
	}
	if deleted {
		w.hist.didRelease(host, session, gen, before)
	}
	if session == w.session {
		delete(w.held, host)
	}
}

// die ends the session: the edge's cleanup releases everything it held, and
// the agent reconnects with a new session of the same instance.
func (w *worker) die(ctx context.Context) {
	w.live.set(w.session, false)
	for _, host := range w.hosts {
		if _, ok := w.held[host]; ok {
			w.release(ctx, host, w.session)
		}
	}
	w.session = w.nextSess.Add(1)
}

// check runs the invariants that hold whatever the other workers do: List
// has at most one owner per hostname, and no reader sees a hostname's
// generation go backwards.
func (w *worker) check(t *testing.T, ctx context.Context) {
	list, err := w.store.List(ctx)
	if err != nil {
		t.Errorf("List: %v", err)
		return
	}
	names := make([]string, len(list))
	for i, b := range list {
		names[i] = b.Hostname
	}
	if !slices.IsSorted(names) || len(slices.Compact(slices.Clone(names))) != len(names) {
		t.Errorf("List is not sorted with one binding per hostname: %v", names)
	}
	for _, host := range w.hosts {
		b, ok, err := w.store.Get(ctx, host)
		if err != nil {
			t.Errorf("Get(%s): %v", host, err)
			continue
		}
		if !ok {
			continue
		}
		if b.Generation < w.seen[host] {
			t.Errorf("Get(%s) went back to generation %d after %d", host, b.Generation, w.seen[host])
		}
		w.seen[host] = b.Generation
	}
}

// testRandomized runs workers that bind, release, flap and die over a few
// hostnames at once. Each step checks what can be checked while others run;
// at the end, with the store quiet, each hostname must be held by exactly
// its highest granted generation unless that very binding was released:
// anything else means a release or bind removed or shadowed a newer owner.
func testRandomized(t *testing.T, newStore newStoreFunc) {
	const workers, steps = 16, 125 // 2000 operations
	hosts := []string{"a.example.com", "b.example.com", "c.example.com"}
	instances := []string{instA, instB, "cccccccccccccccccccccccccccccccc", "dddddddddddddddddddddddddddddddd"}
	l := newLiveness()
	s := newStore(t, l)
	hist := newHistory(t, hosts)
	var nextSess atomic.Uint64
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	var wg sync.WaitGroup
	start := make(chan struct{}) // so that the workers overlap
	for i := range workers {
		w := &worker{
			store: s, live: l, hist: hist, hosts: hosts, nextSess: &nextSess,
			rnd:      rand.New(rand.NewPCG(seed, uint64(i))),
			instance: instances[i%len(instances)], session: nextSess.Add(1),
			held: map[string]uint64{}, seen: map[string]uint64{},
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for range steps {
				w.step(t)
			}
		}()
	}
	close(start)
	wg.Wait()
	for _, host := range hosts {
		top := hist.maxGranted[host]
		if top == 0 {
			t.Errorf("%s was never granted: the test exercised nothing", host)
			continue
		}
		b, ok := get(t, s, host)
		switch {
		case hist.released[host][top] && ok:
			t.Errorf("%s: generation %d was released, yet the store holds %+v", host, top, b)
		case !hist.released[host][top] && (!ok || !reflect.DeepEqual(b, hist.grants[host][top])):
			t.Errorf("%s: want the last grant %+v, the store holds %+v (%v)", host, hist.grants[host][top], b, ok)
		}
	}
	var grants, releases int
	for _, host := range hosts {
		grants += len(hist.grants[host])
		releases += len(hist.released[host])
	}
	t.Logf("%d grants, %d releases", grants, releases)
	if releases == 0 {
		t.Error("no release ever deleted: the test exercised nothing")
	}
}
