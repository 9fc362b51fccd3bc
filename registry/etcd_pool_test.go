package registry_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/registry"
)

// Pools in the cluster, on the real (embedded) etcd: each member is a key
// on its own edge's lease, and every edge's route cache assembles the pool
// from those keys.

const instD = "dddddddddddddddddddddddddddddddd"

// poolOn is the Members of the pool of ms (each as its Bind returned it):
// in the order they joined, which is that of their generations.
func poolOn(ms ...registry.Binding) []registry.Binding {
	ms = slices.Clone(ms)
	slices.SortFunc(ms, func(a, b registry.Binding) int { return cmp.Compare(a.Generation, b.Generation) })
	return ms
}

// isPool reports whether b is a pool of exactly members want.
func isPool(b registry.Binding, ok bool, want []registry.Binding) bool {
	return ok && b.Pool && b.Hostname == host && reflect.DeepEqual(b.Members, want)
}

// cachesPool reports whether n's route cache holds host as a pool of
// exactly members want.
func cachesPool(n *registry.Etcd, want []registry.Binding) bool {
	b, ok := n.Lookup(host)
	return isPool(b, ok, want)
}

// TestEtcdPoolAcrossNodes: members joined on three edges are one pool on
// every edge, by Lookup, Route and Get; one member's release leaves the
// others everywhere; a claim without Pool is refused on every edge while a
// member lives; the name is free after the last release, and a single
// bind then takes it.
func TestEtcdPoolAcrossNodes(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	ctx := context.Background()
	nodes := []*registry.Etcd{
		startNode(t, cli, prefix, "a", registry.Hooks{}),
		startNode(t, cli, prefix, "b", registry.Hooks{}),
		startNode(t, cli, prefix, "c", registry.Hooks{}),
	}
	a, b, c := nodes[0], nodes[1], nodes[2]
	var got []registry.Result
	for i, n := range nodes {
		inst := []string{instA, instB, instC}[i]
		res, err := openBind(t, n, poolClaim(inst, uint64(i+1)))
		if err != nil {
			t.Fatalf("pool claim on %s: %v", n.Node(), err)
		}
		want := registry.Joined
		if i == 0 {
			want = registry.Created
		}
		m := res.Binding
		if res.Outcome != want || m.Pool || m.Node != n.Node() || m.SessionID != uint64(i+1) || m.InstanceID != inst || m.Generation == 0 {
			t.Fatalf("pool claim on %s: %s %+v; want %s, a member of its own", n.Node(), res.Outcome, m, want)
		}
		got = append(got, res)
	}
	ma, mb, mc := got[0].Binding, got[1].Binding, got[2].Binding
	if !(ma.Generation < mb.Generation && mb.Generation < mc.Generation) {
		t.Fatalf("generations %d, %d, %d: not rising in the order of the joins", ma.Generation, mb.Generation, mc.Generation)
	}
	all := poolOn(ma, mb, mc)
	for _, n := range nodes {
		eventually(t, n.Node()+"'s cache to show the pool of three", func() bool { return cachesPool(n, all) })
		r, ok, err := n.Route(ctx, host)
		if err != nil || !isPool(r, ok, all) || r.Generation != mc.Generation || r.TokenID != "tok" {
			t.Fatalf("%s's Route: %+v, %v, %v; want the pool of %+v", n.Node(), r, ok, err, all)
		}
		g, ok, err := n.Get(ctx, host)
		if err != nil || !isPool(g, ok, all) {
			t.Fatalf("%s's Get: %+v, %v, %v", n.Node(), g, ok, err)
		}
	}

	// A claim without Pool, of another instance, is refused everywhere.
	for i, n := range nodes {
		if _, err := openBind(t, n, claim(instD, uint64(10+i))); !errors.Is(err, registry.ErrPooled) {
			t.Fatalf("a claim without Pool on %s against a live pool: %v, want ErrPooled", n.Node(), err)
		}
	}

	// B's member leaves; the others stay, on every edge.
	if ok, err := b.Release(ctx, host, mb.SessionID, mb.Generation); !ok || err != nil {
		t.Fatalf("b's release of its member: %v, %v", ok, err)
	}
	rest := poolOn(ma, mc)
	for _, n := range nodes {
		eventually(t, n.Node()+"'s cache to drop b's member", func() bool { return cachesPool(n, rest) })
	}
	if g, ok, err := c.Get(ctx, host); err != nil || !isPool(g, ok, rest) {
		t.Fatalf("Get after b's release: %+v, %v, %v; want a's and c's members", g, ok, err)
	}
	// Only a's member is left: still a pool, still refusing.
	if ok, err := c.Release(ctx, host, mc.SessionID, mc.Generation); !ok || err != nil {
		t.Fatalf("c's release of its member: %v, %v", ok, err)
	}
	if _, err := openBind(t, c, claim(instD, 20)); !errors.Is(err, registry.ErrPooled) {
		t.Fatalf("a claim without Pool against a's lone member: %v, want ErrPooled", err)
	}
	if ok, err := a.Release(ctx, host, ma.SessionID, ma.Generation); !ok || err != nil {
		t.Fatalf("a's release of the last member: %v, %v", ok, err)
	}
	for _, n := range nodes {
		// The cache first: a Get would bring it up to date by itself.
		eventually(t, n.Node()+"'s cache to drop the pool", func() bool { _, ok := n.Lookup(host); return !ok })
		if g, ok, err := n.Get(ctx, host); err != nil || ok {
			t.Fatalf("%s's Get after the last release: %+v, %v, %v; want the name free", n.Node(), g, ok, err)
		}
	}
	single, err := openBind(t, b, claim(instD, 21))
	if err != nil || single.Outcome != registry.Created || single.Binding.Pool || single.Previous != nil {
		t.Fatalf("a single bind of the free name: %+v, %v; want created", single, err)
	}
	for _, n := range nodes {
		eventually(t, n.Node()+"'s cache to show the single binding", func() bool {
			r, ok := n.Lookup(host)
			return ok && reflect.DeepEqual(r, single.Binding)
		})
	}
}

// TestEtcdPoolLeaseLost: as TestEtcdLeaseLost, with a pool. Edge a, cut
// off from etcd, loses its lease and with it its own member, and no
// other: b's member stays, at its generation, and b is never told it was
// taken over. Back, a's cache shows the pool as b left it.
func TestEtcdPoolLeaseLost(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	ctx := context.Background()
	proxy := tunneltest.StartFaultProxy(t, strings.TrimPrefix(etcdtest.Endpoints(t)[0], "http://"))
	var ha, hb hookLog
	short := func(c *registry.EtcdConfig) { c.LeaseTTL, c.CallTimeout = 2*time.Second, 500*time.Millisecond }
	a := startNode(t, []string{"http://" + proxy.Addr()}, prefix, "a", ha.hooks(), short)
	b := startNode(t, cli, prefix, "b", hb.hooks()) // the default lease: b must not lose its own
	ra, err := openBind(t, a, poolClaim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	rb, err := openBind(t, b, poolClaim(instB, 2))
	if err != nil || rb.Outcome != registry.Joined {
		t.Fatalf("b's member: %+v, %v; want joined", rb, err)
	}
	mb := rb.Binding
	eventually(t, "b's cache to show both members", func() bool { return cachesPool(b, poolOn(ra.Binding, mb)) })

	proxy.Block()
	eventually(t, "a to declare its lease lost", func() bool { return ha.count(func(h *hookLog) int { return h.lost }) == 1 })
	only := []registry.Binding{mb}
	eventually(t, "etcd to expire a's member, and only it", func() bool {
		g, ok, err := b.Get(ctx, host)
		if err != nil {
			t.Fatal(err)
		}
		if !ok || !g.Pool || g.Members[len(g.Members)-1].Generation != mb.Generation {
			t.Fatalf("b's member is gone with a's lease: %+v, %v", g, ok)
		}
		return len(g.Members) == 1
	})
	if g, ok, err := b.Get(ctx, host); err != nil || !isPool(g, ok, only) || g.Generation != mb.Generation {
		t.Fatalf("after a's lease expired: %+v, %v, %v; want b's member alone at generation %d", g, ok, err, mb.Generation)
	}
	eventually(t, "b's cache to drop a's member", func() bool { return cachesPool(b, only) })
	// Still a live pool: b's member keeps the name from others.
	if _, err := openBind(t, b, claim(instD, 3)); !errors.Is(err, registry.ErrPooled) {
		t.Fatalf("a claim without Pool against b's live member: %v, want ErrPooled", err)
	}

	proxy.Unblock()
	eventually(t, "a to register again", func() bool { return ha.count(func(h *hookLog) int { return h.regained }) == 1 && a.Ready() })
	eventually(t, "a's cache to show b's member alone", func() bool { return cachesPool(a, only) })
	if g, ok, err := a.Get(ctx, host); err != nil || !isPool(g, ok, only) {
		t.Fatalf("a's Get once back: %+v, %v, %v; want b's member alone", g, ok, err)
	}
	eventually(t, "a's hook to report its member gone with its lease", func() bool {
		ha.mu.Lock()
		defer ha.mu.Unlock()
		return slices.ContainsFunc(ha.takenOver, func(m registry.Binding) bool { return reflect.DeepEqual(m, ra.Binding) })
	})
	hb.mu.Lock()
	defer hb.mu.Unlock()
	if len(hb.takenOver) != 0 {
		t.Fatalf("b was told its bindings were taken over: %+v", hb.takenOver)
	}
}

// TestEtcdPoolHealth: a member's health, recorded on its edge, reaches
// the other edges with the member's generation as it was, and is cleared
// the same way; SetDown for a generation that is not the member's, for a
// member that is gone, or from an edge that does not hold it writes
// nothing.
func TestEtcdPoolHealth(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	ctx := context.Background()
	a := startNode(t, cli, prefix, "a", registry.Hooks{})
	b := startNode(t, cli, prefix, "b", registry.Hooks{})
	admin := etcdtest.Client(t)
	ra, err := openBind(t, a, poolClaim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	rb, err := openBind(t, b, poolClaim(instB, 2))
	if err != nil {
		t.Fatal(err)
	}
	ma, mb := ra.Binding, rb.Binding
	key := prefix + "members/" + host + "/a/1"
	at := func() (create, mod int64) {
		t.Helper()
		resp, err := admin.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return 0, 0
		}
		return resp.Kvs[0].CreateRevision, resp.Kvs[0].ModRevision
	}
	if create, _ := at(); uint64(create) != ma.Generation {
		t.Fatalf("a's member key created at %d, its generation is %d", create, ma.Generation)
	}
	// health returns a's and b's members as n's cache holds them.
	health := func(n *registry.Etcd) (registry.Binding, registry.Binding, bool) {
		p, ok := n.Lookup(host)
		if !ok || !p.Pool || len(p.Members) != 2 {
			return registry.Binding{}, registry.Binding{}, false
		}
		return p.Members[0], p.Members[1], true
	}
	const why = "dial tcp 127.0.0.1:3000: connection refused"
	if err := a.SetDown(ctx, host, ma.SessionID, ma.Generation, why); err != nil {
		t.Fatal(err)
	}
	down := ma
	down.Down = why
	eventually(t, "b to see a's member down", func() bool {
		x, y, ok := health(b)
		return ok && reflect.DeepEqual(x, down) && reflect.DeepEqual(y, mb)
	})
	if g, ok, err := b.Get(ctx, host); err != nil || !isPool(g, ok, poolOn(down, mb)) || g.Generation != mb.Generation {
		t.Fatalf("b's Get with a's member down: %+v, %v, %v", g, ok, err)
	}
	if create, _ := at(); uint64(create) != ma.Generation {
		t.Fatalf("SetDown moved a's member's key to %d, from its generation %d", create, ma.Generation)
	}

	if err := a.SetDown(ctx, host, ma.SessionID, ma.Generation, ""); err != nil {
		t.Fatal(err)
	}
	eventually(t, "b to see a's member up again", func() bool {
		x, y, ok := health(b)
		return ok && reflect.DeepEqual(x, ma) && reflect.DeepEqual(y, mb)
	})

	// Writes nothing: another generation, another edge, a member gone.
	_, before := at()
	for _, wrong := range []struct {
		n   *registry.Etcd
		gen uint64
	}{{a, ma.Generation + 1}, {a, mb.Generation}, {a, 0}, {b, ma.Generation}} {
		if err := wrong.n.SetDown(ctx, host, ma.SessionID, wrong.gen, "x"); err != nil {
			t.Fatalf("SetDown on %s at generation %d: %v, want nil", wrong.n.Node(), wrong.gen, err)
		}
		if _, mod := at(); mod != before {
			t.Fatalf("SetDown on %s at generation %d (a's member is at %d) rewrote it", wrong.n.Node(), wrong.gen, ma.Generation)
		}
	}
	if g, ok, err := b.Get(ctx, host); err != nil || !isPool(g, ok, poolOn(ma, mb)) {
		t.Fatalf("after SetDown with wrong generations: %+v, %v, %v; want both members up", g, ok, err)
	}
	if ok, err := a.Release(ctx, host, ma.SessionID, ma.Generation); !ok || err != nil {
		t.Fatalf("a's release: %v, %v", ok, err)
	}
	if err := a.SetDown(ctx, host, ma.SessionID, ma.Generation, "x"); err != nil {
		t.Fatalf("SetDown of a released member: %v, want nil", err)
	}
	if create, _ := at(); create != 0 {
		t.Fatalf("SetDown of a released member wrote its key again (created at %d)", create)
	}
	if g, ok, err := b.Get(ctx, host); err != nil || !isPool(g, ok, []registry.Binding{mb}) {
		t.Fatalf("after SetDown of a released member: %+v, %v, %v; want b's member alone", g, ok, err)
	}
}

// TestEtcdPoolTakenOverHook: a's member is replaced by rule 1 (its
// instance, a new session) through b. a's hook reports that member, as it
// was bound, and no other: not a's other member, not b's; b's hook reports
// nothing.
func TestEtcdPoolTakenOverHook(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	ctx := context.Background()
	var ha, hb hookLog
	a := startNode(t, cli, prefix, "a", ha.hooks())
	b := startNode(t, cli, prefix, "b", hb.hooks())
	old, err := openBind(t, a, poolClaim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	keep, err := openBind(t, a, poolClaim(instC, 3))
	if err != nil {
		t.Fatal(err)
	}
	other, err := openBind(t, b, poolClaim(instB, 2))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "a's cache to show the three members", func() bool {
		return cachesPool(a, poolOn(old.Binding, keep.Binding, other.Binding))
	})
	moved, err := openBind(t, b, poolClaim(instA, 4))
	if err != nil || moved.Outcome != registry.SameInstance || moved.Previous == nil || !reflect.DeepEqual(*moved.Previous, old.Binding) {
		t.Fatalf("a's instance again on b: %+v, %v; want same_instance replacing %+v", moved, err, old.Binding)
	}
	eventually(t, "a's hook to report its replaced member", func() bool {
		return ha.count(func(h *hookLog) int { return len(h.takenOver) }) >= 1
	})
	// A later write by b, seen on a: everything before it was applied
	// there, and its hooks called, by then.
	if err := b.SetDown(ctx, host, moved.Binding.SessionID, moved.Binding.Generation, "sentinel"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a to see b's later write", func() bool {
		p, ok := a.Lookup(host)
		m, found := p.Member(moved.Binding.Generation)
		return ok && found && m.Down == "sentinel"
	})
	ha.mu.Lock()
	told := slices.Clone(ha.takenOver)
	ha.mu.Unlock()
	if len(told) != 1 || !reflect.DeepEqual(told[0], old.Binding) {
		t.Fatalf("a's hook reported %+v; want exactly its replaced member %+v", told, old.Binding)
	}
	if n := hb.count(func(h *hookLog) int { return len(h.takenOver) }); n != 0 {
		t.Fatalf("b's hook reported %d bindings taken over: %+v", n, hb.takenOver)
	}
}

// TestEtcdPoolSingleRace: eight agents on three edges claim one hostname
// at once, as pools of one token, alone (no Pool) with another token, and
// now and then as a pool of that other token; they release what they
// hold, or drop their session and leave it to a dead holder. At no
// revision does etcd hold both the hostname's binding and pool members,
// nor members of two tokens: a watch from before the first claim checks
// each revision, and a read checks the end.
func TestEtcdPoolSingleRace(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	admin := etcdtest.Client(t)
	nodes := []*registry.Etcd{
		startNode(t, cli, prefix, "a", registry.Hooks{}),
		startNode(t, cli, prefix, "b", registry.Hooks{}),
		startNode(t, cli, prefix, "c", registry.Hooks{}),
	}
	hostKey, memberPrefix := prefix+"hosts/"+host, prefix+"members/"+host+"/"
	sentinel := prefix + "zz-sentinel"

	// The watch, from the revision before the first claim, replays the
	// two keys' history and checks the rule at every revision.
	start, err := admin.Get(context.Background(), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	wctx, stopWatch := context.WithCancel(context.Background())
	defer stopWatch()
	wch := admin.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(start.Header.Revision+1))
	checked := make(chan error, 1)
	var revisions atomic.Int64
	go func() {
		checked <- replay(wch, hostKey, memberPrefix, sentinel, &revisions)
	}()

	const workers, rounds = 8, 25 // 200 claims
	deadline := time.Now().Add(6 * time.Second)
	var granted, refused, busy atomic.Int64
	outcomes := map[registry.Outcome]*atomic.Int64{}
	for _, o := range []registry.Outcome{registry.Created, registry.Joined, registry.SameInstance, registry.DeadHolder, registry.Unchanged} {
		outcomes[o] = &atomic.Int64{}
	}
	agents := make([]*raceAgent, workers)
	for w := range agents {
		agents[w] = &raceAgent{t: t, n: nodes[w%len(nodes)], w: w, inst: fmt.Sprintf("%032d", w),
			rnd: rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))}
	}
	// Each round the agents claim at once, the name as the last round
	// left it, and then each releases what it holds, goes (its session
	// closed, its binding left to a dead holder), or stays, while the
	// slower ones still claim. Every third round they all release, so
	// that the next starts with the name free but for dead holders.
	for round := 0; round < rounds && time.Now().Before(deadline); round++ {
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, ag := range agents {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				res, err := ag.claim(round)
				switch {
				case err == nil:
					granted.Add(1)
					outcomes[res.Outcome].Add(1)
				case errors.Is(err, registry.ErrTaken):
					refused.Add(1)
				case errors.Is(err, registry.ErrUnavailable):
					busy.Add(1) // bindAttempts lost to the others
				default:
					t.Errorf("%s: claim: %v", ag.n.Node(), err)
				}
				ag.leave(round%3 == 2)
			}()
		}
		close(start)
		wg.Wait()
	}
	if _, err := admin.Put(context.Background(), sentinel, "end"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-checked:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not reach the end of the run")
	}
	t.Logf("%d granted (%d created, %d joined, %d same instance, %d dead holder, %d unchanged), %d refused, %d out of attempts; %d revisions checked",
		granted.Load(), outcomes[registry.Created].Load(), outcomes[registry.Joined].Load(), outcomes[registry.SameInstance].Load(),
		outcomes[registry.DeadHolder].Load(), outcomes[registry.Unchanged].Load(), refused.Load(), busy.Load(), revisions.Load())
	if granted.Load() == 0 || refused.Load() == 0 {
		t.Fatalf("granted %d, refused %d: the run did not contend", granted.Load(), refused.Load())
	}

	// The end state, read at one revision, and as every edge sees it.
	tr, err := admin.Txn(context.Background()).Then(clientv3.OpGet(hostKey), clientv3.OpGet(memberPrefix, clientv3.WithPrefix())).Commit()
	if err != nil {
		t.Fatal(err)
	}
	hosts, ms := tr.Responses[0].GetResponseRange().Kvs, tr.Responses[1].GetResponseRange().Kvs
	state := map[string][]byte{}
	for _, kv := range append(hosts, ms...) {
		state[string(kv.Key)] = kv.Value
	}
	if err := poolRule(state, hostKey, memberPrefix); err != nil {
		t.Fatalf("at the end: %v", err)
	}
	final, ok, err := nodes[0].Get(context.Background(), host)
	if err != nil {
		t.Fatal(err)
	}
	owners := 0
	if ok {
		owners = len(final.Owners())
	}
	if owners != max(len(hosts), len(ms)) || ok != (len(state) > 0) {
		t.Fatalf("Get says %+v, %v; etcd holds %d bindings and %d members", final, ok, len(hosts), len(ms))
	}
	for _, n := range nodes {
		eventually(t, n.Node()+"'s cache to agree with etcd", func() bool {
			r, rok := n.Lookup(host)
			return rok == ok && (!ok || reflect.DeepEqual(r, final))
		})
	}
}

// replay applies the events of wch to the keys hostKey and those under
// memberPrefix, and checks poolRule on the state at each revision, until
// the sentinel key is written.
func replay(wch clientv3.WatchChan, hostKey, memberPrefix, sentinel string, revisions *atomic.Int64) error {
	state := map[string][]byte{}
	var rev int64
	for wr := range wch {
		if err := wr.Err(); err != nil {
			return fmt.Errorf("watch: %w", err)
		}
		for _, ev := range wr.Events {
			if ev.Kv.ModRevision != rev {
				// Every event of the revision before has been applied.
				if err := poolRule(state, hostKey, memberPrefix); err != nil {
					return fmt.Errorf("at revision %d: %w", rev, err)
				}
				rev = ev.Kv.ModRevision
				revisions.Add(1)
			}
			k := string(ev.Kv.Key)
			switch {
			case k == sentinel:
				return poolRule(state, hostKey, memberPrefix)
			case k != hostKey && !strings.HasPrefix(k, memberPrefix):
			case ev.Type == clientv3.EventTypeDelete:
				delete(state, k)
			default:
				state[k] = ev.Kv.Value
			}
		}
	}
	return errors.New("the watch ended before the sentinel")
}

// poolRule is the rule state (key to value) must hold: the hostname's
// binding and pool members never both, and members all of one token.
func poolRule(state map[string][]byte, hostKey, memberPrefix string) error {
	_, single := state[hostKey]
	tokens := map[string]bool{}
	var keys []string
	for k, v := range state {
		if !strings.HasPrefix(k, memberPrefix) {
			continue
		}
		keys = append(keys, strings.TrimPrefix(k, memberPrefix))
		var r struct {
			TokenID string `json:"token_id"`
		}
		if err := json.Unmarshal(v, &r); err != nil {
			return fmt.Errorf("member %s: %w", k, err)
		}
		tokens[r.TokenID] = true
	}
	slices.Sort(keys)
	switch {
	case single && len(keys) > 0:
		return fmt.Errorf("the binding %s and members %v both exist", state[hostKey], keys)
	case len(tokens) > 1:
		return fmt.Errorf("members %v are of tokens %v", keys, tokens)
	}
	return nil
}

// raceAgent is one agent of TestEtcdPoolSingleRace, on edge n.
type raceAgent struct {
	t       *testing.T
	n       *registry.Etcd
	w       int
	inst    string
	rnd     *rand.Rand
	session uint64            // open, or 0
	held    *registry.Binding // granted to session, or nil
}

// claim binds host from the agent's session (a new one unless it stayed),
// as a pool of token "pool" (half the claims), alone with token "solo",
// or as a pool of "solo" (one in eight).
func (ag *raceAgent) claim(round int) (registry.Result, error) {
	ctx := context.Background()
	if ag.session == 0 {
		ag.session = uint64(ag.w*1000 + round + 1)
		if err := ag.n.OpenSession(ctx, registry.Session{ID: ag.session}); err != nil {
			return registry.Result{}, err
		}
	}
	c := registry.Claim{Hostname: host, InstanceID: ag.inst, SessionID: ag.session, Node: ag.n.Node()}
	switch k := ag.rnd.IntN(8); {
	case k < 4:
		c.TokenID, c.Pool = "pool", true
	case k < 7:
		c.TokenID = "solo"
	default:
		c.TokenID, c.Pool = "solo", true
	}
	res, err := ag.n.Bind(ctx, c)
	if err != nil {
		return res, err
	}
	b := res.Binding
	if b.Pool || b.SessionID != c.SessionID || b.InstanceID != c.InstanceID || b.TokenID != c.TokenID || b.Node != c.Node {
		ag.t.Errorf("%s: Bind(%+v) granted %+v", c.Node, c, b)
	}
	ag.held = &b
	return res, nil
}

// leave releases what the agent holds (half the time, or always when
// drain), or closes its session, leaving it to a dead holder (a quarter),
// or stays.
func (ag *raceAgent) leave(drain bool) {
	ctx := context.Background()
	r := ag.rnd.IntN(4)
	if drain {
		r = 0
	}
	switch {
	case r < 2 && ag.held != nil:
		// Its session is live: no other agent may have removed it.
		if ok, err := ag.n.Release(ctx, host, ag.held.SessionID, ag.held.Generation); !ok || err != nil {
			ag.t.Errorf("%s: release of %+v: %v, %v", ag.n.Node(), *ag.held, ok, err)
		}
		ag.held = nil
	case r == 2 && ag.session != 0:
		if err := ag.n.CloseSession(ctx, ag.session); err != nil {
			ag.t.Errorf("%s: close session %d: %v", ag.n.Node(), ag.session, err)
		}
		ag.session, ag.held = 0, nil
	}
}
