package registry_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/registry"
)

// TestEtcd runs the Store contract against the etcd store: the same test
// bodies as TestMemory.
func TestEtcd(t *testing.T) {
	testStore(t, func(t *testing.T, l *liveness) registry.Store { return newEtcdNodes(t, l) })
}

// newEtcdNodes returns a cluster of its own prefix, seen as one Store,
// whose sessions' liveness follows l.
func newEtcdNodes(t *testing.T, l *liveness) *etcdNodes {
	h := &etcdNodes{t: t, cli: etcdtest.Endpoints(t), prefix: etcdtest.Prefix(t), l: l,
		stores: map[string]*registry.Etcd{}, opened: map[sessionOn]bool{}}
	l.uncounted = true
	l.hook = h.setLive
	return h
}

// etcdNodes is one cluster seen as one Store: each claim goes through the
// store of its Node, as it would on that edge, and the liveness the test
// steers becomes those nodes' session keys.
type etcdNodes struct {
	t      *testing.T
	cli    []string
	prefix string
	l      *liveness

	mu     sync.Mutex
	stores map[string]*registry.Etcd
	opened map[sessionOn]bool
	now    func() time.Time // every node's reservation clock, once set
}

type sessionOn struct {
	node    string
	session uint64
}

func (h *etcdNodes) node(name string) *registry.Etcd {
	h.mu.Lock()
	defer h.mu.Unlock()
	if s, ok := h.stores[name]; ok {
		return s
	}
	s := startNode(h.t, h.cli, h.prefix, name, registry.Hooks{})
	if h.now != nil {
		s.SetClock(h.now)
	}
	h.stores[name] = s
	return s
}

// SetClock sets the reservation clock of every node, and of those to come.
func (h *etcdNodes) SetClock(now func() time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.now = now
	for _, s := range h.stores {
		s.SetClock(now)
	}
}

func (h *etcdNodes) Reservation(ctx context.Context, key string) (registry.Reservation, bool, error) {
	return h.node("").Reservation(ctx, key)
}

func (h *etcdNodes) ReservedFor(ctx context.Context, tokenID, label string) ([]registry.Reservation, error) {
	return h.node("").ReservedFor(ctx, tokenID, label)
}

func (h *etcdNodes) Bind(ctx context.Context, c registry.Claim) (registry.Result, error) {
	s := h.node(c.Node)
	key := sessionOn{c.Node, c.SessionID}
	h.mu.Lock()
	open := !h.opened[key] && !h.l.isDead(c.SessionID)
	h.opened[key] = h.opened[key] || open
	h.mu.Unlock()
	if open {
		if err := s.OpenSession(ctx, registry.Session{ID: c.SessionID}); err != nil {
			return registry.Result{}, err
		}
	}
	return s.Bind(ctx, c)
}

func (h *etcdNodes) setLive(session uint64, alive bool) {
	h.mu.Lock()
	var on []sessionOn
	for k := range h.opened {
		if k.session == session {
			on = append(on, k)
		}
	}
	h.mu.Unlock()
	for _, k := range on {
		s := h.node(k.node)
		var err error
		if alive {
			err = s.OpenSession(context.Background(), registry.Session{ID: session})
		} else {
			err = s.CloseSession(context.Background(), session)
		}
		if err != nil {
			h.t.Errorf("session %d alive=%v: %v", session, alive, err)
		}
	}
}

func (h *etcdNodes) Release(ctx context.Context, hostname string, session, gen uint64) (bool, error) {
	return h.node("").Release(ctx, hostname, session, gen)
}

func (h *etcdNodes) Get(ctx context.Context, hostname string) (registry.Binding, bool, error) {
	return h.node("").Get(ctx, hostname)
}

func (h *etcdNodes) List(ctx context.Context) ([]registry.Binding, error) {
	return h.node("").List(ctx)
}

func startNode(t *testing.T, cli []string, prefix, name string, hooks registry.Hooks, tune ...func(*registry.EtcdConfig)) *registry.Etcd {
	t.Helper()
	cfg := registry.EtcdConfig{Endpoints: cli, Prefix: prefix, Node: name,
		LeaseTTL: 6 * time.Second, RetryInterval: 50 * time.Millisecond, CallTimeout: time.Second, RouteStaleness: time.Second,
		Log: tunneltest.Logger().With("node", name)}
	for _, f := range tune {
		f(&cfg)
	}
	s := registry.NewEtcd(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Start(ctx, name+":7443", hooks); err != nil {
		t.Fatalf("start node %q: %v", name, err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// hookLog records what a node's hooks were told.
type hookLog struct {
	mu        sync.Mutex
	takenOver []registry.Binding
	lost      int
	lostErr   error // why the lease was lost, the last time
	regained  int
}

func (h *hookLog) hooks() registry.Hooks {
	return registry.Hooks{
		TakenOver: func(b registry.Binding) { h.mu.Lock(); h.takenOver = append(h.takenOver, b); h.mu.Unlock() },
		Lost:      func(err error) { h.mu.Lock(); h.lost, h.lostErr = h.lost+1, err; h.mu.Unlock() },
		Regained:  func() { h.mu.Lock(); h.regained++; h.mu.Unlock() },
	}
}

func (h *hookLog) lostError() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lostErr
}

func (h *hookLog) count(f func(*hookLog) int) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return f(h)
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func openBind(t *testing.T, s *registry.Etcd, c registry.Claim) (registry.Result, error) {
	t.Helper()
	c.Node = s.Node()
	if err := s.OpenSession(context.Background(), registry.Session{ID: c.SessionID}); err != nil {
		t.Fatal(err)
	}
	return s.Bind(context.Background(), c)
}

// TestEtcdAcrossNodes: a takeover on node B reaches node A through the
// watch, both route caches follow, and a live holder on A refuses another
// instance on B until A closes its session.
func TestEtcdAcrossNodes(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	var ha hookLog
	a := startNode(t, cli, prefix, "a", ha.hooks())
	b := startNode(t, cli, prefix, "b", registry.Hooks{})
	if addr, ok := b.NodeAddr("a"); !ok || addr != "a:7443" {
		t.Fatalf("NodeAddr(a) = %q, %v", addr, ok)
	}
	first, err := openBind(t, a, claim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "b's route cache to learn a's binding", func() bool {
		r, ok := b.Lookup(host)
		return ok && reflect.DeepEqual(r, first.Binding)
	})
	if _, err := openBind(t, b, claim(instB, 1)); err != registry.ErrTaken {
		t.Fatalf("another instance on b = %v while a's holder is live; want ErrTaken", err)
	}
	second, err := openBind(t, b, claim(instA, 2))
	if err != nil || second.Outcome != registry.SameInstance || second.Previous == nil || !reflect.DeepEqual(*second.Previous, first.Binding) {
		t.Fatalf("same instance on b = %+v, %v", second, err)
	}
	eventually(t, "a to hear of the takeover", func() bool {
		return ha.count(func(h *hookLog) int { return len(h.takenOver) }) == 1
	})
	if got := ha.takenOver[0]; !reflect.DeepEqual(got, first.Binding) {
		t.Fatalf("a was told %+v, want %+v", got, first.Binding)
	}
	eventually(t, "a's route cache to follow", func() bool {
		r, ok := a.Lookup(host)
		return ok && reflect.DeepEqual(r, second.Binding)
	})
	// B's session ends: rule 2 opens at once to any other instance, on any node.
	if _, err := openBind(t, a, claim(instB, 3)); err != registry.ErrTaken {
		t.Fatalf("bind on a while b's holder is live = %v, want ErrTaken", err)
	}
	if err := b.CloseSession(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	third, err := openBind(t, a, claim(instB, 3))
	if err != nil || third.Outcome != registry.DeadHolder {
		t.Fatalf("bind on a after b's session closed = %+v, %v; want dead_holder", third, err)
	}
}

// TestEtcdLeaseLost cuts a node off from etcd: it reports the lease lost
// before etcd expires it, its binding disappears after the TTL so another
// node may bind, and it registers again when etcd is back.
func TestEtcdLeaseLost(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	proxy := tunneltest.StartFaultProxy(t, strings.TrimPrefix(etcdtest.Endpoints(t)[0], "http://"))
	var ha hookLog
	short := func(c *registry.EtcdConfig) { c.LeaseTTL, c.CallTimeout = 2*time.Second, 500*time.Millisecond }
	a := startNode(t, []string{"http://" + proxy.Addr()}, prefix, "a", ha.hooks(), short)
	b := startNode(t, cli, prefix, "b", registry.Hooks{}) // the default lease: b must not lose its own
	if _, err := openBind(t, a, claim(instA, 1)); err != nil {
		t.Fatal(err)
	}
	proxy.Block()
	cut := time.Now()
	eventually(t, "a to declare its lease lost", func() bool { return ha.count(func(h *hookLog) int { return h.lost }) == 1 })
	lostAfter := time.Since(cut)
	if a.Ready() {
		t.Fatal("a is ready without a lease")
	}
	if _, err := a.Bind(context.Background(), claim(instA, 1)); err != registry.ErrUnavailable {
		t.Fatalf("bind on a without a lease = %v, want ErrUnavailable", err)
	}
	var took registry.Result
	eventually(t, "b to bind the name once a's lease expired", func() bool {
		var err error
		took, err = openBind(t, b, claim(instB, 1))
		return err == nil
	})
	expiredAfter := time.Since(cut)
	t.Logf("lease lost declared after %v, name free after %v", lostAfter.Round(time.Millisecond), expiredAfter.Round(time.Millisecond))
	if lostAfter >= expiredAfter {
		t.Fatalf("a declared its lease lost (%v) only after etcd expired it (%v)", lostAfter, expiredAfter)
	}
	if took.Outcome != registry.Created {
		t.Fatalf("outcome %s, want created: the lease should have removed a's binding", took.Outcome)
	}
	proxy.Unblock()
	eventually(t, "a to register again", func() bool { return ha.count(func(h *hookLog) int { return h.regained }) == 1 && a.Ready() })
	eventually(t, "a's cache to show b's binding", func() bool {
		r, ok := a.Lookup(host)
		return ok && reflect.DeepEqual(r, took.Binding)
	})
}

// TestEtcdLeaseOnHungMembers: two of the three paths a node has to etcd
// hang (open, silent) for as long as its lease may go unrenewed. A
// renewal stream on a hung path stalls until gRPC's keepalive drops the
// connection (10 s and two call timeouts); the lessor then renews on the
// path that answers, and the node keeps its lease: the lease TTL (24 s
// here) outlasts the keepalive floor. The three paths lead to one etcd
// server, so that the hang is of the path alone. About 16 s.
func TestEtcdLeaseOnHungMembers(t *testing.T) {
	prefix := etcdtest.Prefix(t)
	var paths []*tunneltest.FaultProxy
	var eps []string
	for range 3 {
		p := tunneltest.StartFaultProxy(t, strings.TrimPrefix(etcdtest.Endpoints(t)[0], "http://"))
		paths, eps = append(paths, p), append(eps, "http://"+p.Addr())
	}
	var h hookLog
	var cfg registry.EtcdConfig
	a := startNode(t, eps, prefix, "a", h.hooks(), func(c *registry.EtcdConfig) {
		c.LeaseTTL, c.CallTimeout = 24*time.Second, 500*time.Millisecond
		cfg = *c
	})
	for _, p := range paths[:2] {
		p.Block()
	}
	t.Cleanup(func() {
		for _, p := range paths {
			p.Unblock() // before the node closes, so that it revokes its lease
		}
	})
	hang := 2 * cfg.LeaseTTL / 3
	for start := time.Now(); time.Since(start) < hang; time.Sleep(10 * time.Millisecond) {
		if lost := h.count(func(h *hookLog) int { return h.lost }); lost != 0 || !a.Ready() {
			t.Fatalf("%v into the hang of two paths of three: lease lost %d times, ready %v: %v", time.Since(start).Round(time.Millisecond), lost, a.Ready(), h.lostError())
		}
	}
}

// TestEtcdSixteenNodesRace: sixteen edges, each with another instance,
// bind one hostname at once: exactly one creates it. Another may win after
// it only by rule 2, from a holder whose edge had lost its lease (which a
// loaded machine can make happen with the tests' 2 s lease): never two
// live holders.
func TestEtcdSixteenNodesRace(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	const n = 16
	nodes := make([]*registry.Etcd, n)
	logs := make([]*hookLog, n)
	byNode := map[string]*hookLog{}
	for i := range nodes {
		logs[i] = &hookLog{}
		nodes[i] = startNode(t, cli, prefix, fmt.Sprintf("edge-%d", i), logs[i].hooks())
		byNode[nodes[i].Node()] = logs[i]
	}
	for round := range 5 {
		hostname := fmt.Sprintf("race%d.example.com", round)
		var mu sync.Mutex
		var wins []registry.Result
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i, s := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := registry.Claim{Hostname: hostname, InstanceID: fmt.Sprintf("%032d", i), TokenID: "tok", SessionID: uint64(round + 1), Node: s.Node()}
				if err := s.OpenSession(context.Background(), registry.Session{ID: c.SessionID}); err != nil {
					t.Error(err)
					return
				}
				<-start
				res, err := s.Bind(context.Background(), c)
				switch {
				case err == nil:
					mu.Lock()
					wins = append(wins, res)
					mu.Unlock()
				case err != registry.ErrTaken:
					t.Errorf("edge-%d: %v", i, err)
				}
			}()
		}
		close(start)
		wg.Wait()
		if len(wins) == 0 {
			t.Fatalf("round %d: no edge won the bind", round)
		}
		slices.SortFunc(wins, func(a, b registry.Result) int { return cmp.Compare(a.Binding.Generation, b.Binding.Generation) })
		if wins[0].Outcome != registry.Created {
			t.Fatalf("round %d: the first win was %s, want created", round, wins[0].Outcome)
		}
		for _, w := range wins[1:] {
			if w.Outcome != registry.DeadHolder || w.Previous == nil || byNode[w.Previous.Node].count(func(h *hookLog) int { return h.lost }) == 0 {
				t.Fatalf("round %d: %d edges won the bind: %+v after %+v, from a holder whose edge kept its lease", round, len(wins), w, wins[0])
			}
			t.Logf("round %d: %s took the name from %s after that edge lost its lease", round, w.Binding.Node, w.Previous.Node)
		}
		last := wins[len(wins)-1].Binding
		b, ok, err := nodes[0].Get(context.Background(), hostname)
		if err != nil || !ok || !reflect.DeepEqual(b, last) {
			t.Fatalf("round %d: registry holds %+v, %v, %v; the last winner was told %+v", round, b, ok, err, last)
		}
	}
}

// TestEtcdNodeNameInUse: a second edge with a live edge's name is refused
// with an error that names the setting.
func TestEtcdNodeNameInUse(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	startNode(t, cli, prefix, "a", registry.Hooks{})
	// Start waits for the name's lease to expire until its context ends;
	// the context ends once it has said it waits (not at a fixed time,
	// which a loaded machine could reach before the name was even asked).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dup := registry.NewEtcd(registry.EtcdConfig{Endpoints: cli, Prefix: prefix, Node: "a", LeaseTTL: time.Second, RetryInterval: 20 * time.Millisecond,
		Log: slog.New(onMessage{"node name still registered", cancel})})
	err := dup.Start(ctx, "a:7443", registry.Hooks{})
	if err == nil {
		dup.Close()
		t.Fatal("a second edge named a started")
	}
	if !strings.Contains(err.Error(), "--node-name") {
		t.Fatalf("error %q does not say which setting to change", err)
	}
}

// onMessage is a log handler that calls f at each record whose message
// starts with msg.
type onMessage struct {
	msg string
	f   func()
}

func (h onMessage) Enabled(context.Context, slog.Level) bool { return true }
func (h onMessage) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h onMessage) WithGroup(string) slog.Handler            { return h }
func (h onMessage) Handle(_ context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, h.msg) {
		h.f()
	}
	return nil
}

// TestEtcdAuth: against an etcd with auth enabled, the store binds with a
// user's password, and a wrong password stops Start with etcd's reason.
func TestEtcdAuth(t *testing.T) {
	endpoints := etcdtest.StartSeparate(t)
	enableAuth(t, endpoints)
	ctx := context.Background()
	good := registry.NewEtcd(registry.EtcdConfig{Endpoints: endpoints, Username: "root", Password: "rootpw", Node: "a", LeaseTTL: time.Second})
	if err := good.Start(ctx, "a:7443", registry.Hooks{}); err != nil {
		t.Fatalf("start with the right password: %v", err)
	}
	t.Cleanup(func() { good.Close() })
	if _, err := openBind(t, good, claim(instA, 1)); err != nil {
		t.Fatalf("bind with auth: %v", err)
	}
	bad := registry.NewEtcd(registry.EtcdConfig{Endpoints: endpoints, Username: "root", Password: "wrong", Node: "b"})
	err := bad.Start(ctx, "b:7443", registry.Hooks{})
	if err == nil {
		bad.Close()
		t.Fatal("started with a wrong password")
	}
	if !strings.Contains(err.Error(), "authentication failed") {
		t.Fatalf("wrong password: %v; want etcd's reason", err)
	}
}

// enableAuth turns auth on in the etcd at endpoints, with user root,
// password rootpw.
func enableAuth(t *testing.T, endpoints []string) {
	admin := etcdtest.ClientAt(t, endpoints...)
	ctx := context.Background()
	for _, step := range []func() error{
		func() error { _, err := admin.UserAdd(ctx, "root", "rootpw"); return err },
		func() error { _, err := admin.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := admin.AuthEnable(ctx); return err },
	} {
		if err := step(); err != nil {
			t.Fatalf("enable auth: %v", err)
		}
	}
}

// TestEtcdSessions: every node sees every node's live sessions, with the
// token and instance each presented, until each is closed.
func TestEtcdSessions(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	a := startNode(t, cli, prefix, "a", registry.Hooks{})
	b := startNode(t, cli, prefix, "b", registry.Hooks{})
	ctx := context.Background()
	if err := a.OpenSession(ctx, registry.Session{ID: 1, TokenID: "t1", InstanceID: "i1"}); err != nil {
		t.Fatal(err)
	}
	if err := b.OpenSession(ctx, registry.Session{ID: 1, TokenID: "t2", InstanceID: "i2", Node: "ignored"}); err != nil {
		t.Fatal(err)
	}
	want := []registry.Session{{Node: "a", ID: 1, TokenID: "t1", InstanceID: "i1"}, {Node: "b", ID: 1, TokenID: "t2", InstanceID: "i2"}}
	for _, s := range []*registry.Etcd{a, b} {
		got, err := s.Sessions(ctx)
		if err != nil || fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s's Sessions: %v %v, want %v", s.Node(), got, err, want)
		}
	}
	if err := a.CloseSession(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Sessions(ctx); err != nil || fmt.Sprint(got) != fmt.Sprint(want[1:]) {
		t.Fatalf("after a closed its session: %v %v, want %v", got, err, want[1:])
	}
}

// TestEtcdRouteUnconfirmed: node b's path to etcd goes silent. Its route
// cache, which etcd can no longer confirm current, is trusted for
// RouteStaleness and no longer: then Route refuses (ErrUnavailable)
// rather than answer the binding a has since replaced, which Lookup still
// shows; once the path is back, Route answers the new binding.
func TestEtcdRouteUnconfirmed(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	proxy := tunneltest.StartFaultProxy(t, strings.TrimPrefix(cli[0], "http://"))
	a := startNode(t, cli, prefix, "a", registry.Hooks{})
	const staleness = 300 * time.Millisecond
	b := startNode(t, []string{"http://" + proxy.Addr()}, prefix, "b", registry.Hooks{}, func(c *registry.EtcdConfig) {
		c.LeaseTTL, c.RouteStaleness, c.CallTimeout = 10*time.Second, staleness, 100*time.Millisecond
	})
	t.Cleanup(proxy.Unblock) // before b's Close
	ctx := context.Background()
	first, err := openBind(t, a, claim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "b to route to the first binding", func() bool {
		r, ok, err := b.Route(ctx, host)
		return err == nil && ok && reflect.DeepEqual(r, first.Binding)
	})
	proxy.Block()
	blocked := time.Now()
	second, err := openBind(t, a, claim(instA, 2))
	if err != nil {
		t.Fatal(err)
	}
	var refusedAfter time.Duration
	for refusedAfter == 0 {
		start := time.Now()
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		r, _, err := b.Route(rctx, host)
		cancel()
		switch {
		case err != nil && !errors.Is(err, registry.ErrUnavailable):
			t.Fatalf("Route while cut off: %v, want ErrUnavailable", err)
		case err != nil:
			refusedAfter = time.Since(blocked)
		case start.Sub(blocked) > staleness:
			t.Fatalf("Route answered %+v from a cache unconfirmed for %v (bound %v)", r, start.Sub(blocked), staleness)
		case time.Since(blocked) > 10*time.Second:
			t.Fatal("Route still answers from the cache 10s after its path went silent")
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("Route refused %v after b's path went silent (bound %v)", refusedAfter.Round(time.Millisecond), staleness)
	if r, _ := b.Lookup(host); !reflect.DeepEqual(r, first.Binding) {
		t.Fatalf("b's cache holds %+v; the test needs it stale", r)
	}
	if m := b.RouteStats(); m.Failed == 0 || m.Age < staleness {
		t.Fatalf("route stats while cut off: %+v", m)
	}
	proxy.Unblock()
	eventually(t, "b to route to the second binding", func() bool {
		r, ok, err := b.Route(ctx, host)
		return err == nil && ok && reflect.DeepEqual(r, second.Binding)
	})
}

// TestEtcdWatchStalled: node b reaches one etcd member by two paths, and
// the one carrying its watch goes silent (open, no answers) while a takes
// the hostname over. b routes the new binding within its staleness bound,
// by reading it, then its watch moves to the other path and its cache
// follows: etcd confirms it current again, which only a watch that
// delivers allows (the read that routed the binding put it in the cache
// too). The new stream may land on the silent path again, and is replaced
// again a round later, until one lands on the other path or gRPC's
// keepalive drops the silent connection (10 s and two call timeouts).
// b's lease holds throughout.
func TestEtcdWatchStalled(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	target := strings.TrimPrefix(cli[0], "http://")
	paths := []*tunneltest.FaultProxy{tunneltest.StartFaultProxy(t, target), tunneltest.StartFaultProxy(t, target)}
	var hb hookLog
	// watchReplaced is gRPC's keepalive, with room for a loaded machine.
	const staleness, watchReplaced = 500 * time.Millisecond, 14 * time.Second
	b := startNode(t, []string{"http://" + paths[0].Addr(), "http://" + paths[1].Addr()}, prefix, "b", hb.hooks(), func(c *registry.EtcdConfig) {
		// A lease that outlasts a renewal stream on the silent path.
		c.LeaseTTL, c.RouteStaleness, c.CallTimeout = 30*time.Second, staleness, 150*time.Millisecond
	})
	for _, p := range paths {
		t.Cleanup(p.Unblock)
	}
	a := startNode(t, cli, prefix, "a", registry.Hooks{})
	ctx := context.Background()
	first, err := openBind(t, a, claim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "b to learn the first binding", func() bool { r, _ := b.Lookup(host); return reflect.DeepEqual(r, first.Binding) })

	watchPath := carrier(t, paths, prefix)
	watchPath.Block()
	frozen := time.Now()
	second, err := openBind(t, a, claim(instA, 2))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "b to route to the second binding", func() bool {
		r, ok, err := b.Route(ctx, host)
		return err == nil && ok && reflect.DeepEqual(r, second.Binding)
	})
	routed := time.Since(frozen)
	for b.RouteStats().Age >= staleness {
		if time.Since(frozen) > watchReplaced {
			t.Fatalf("b's cache not confirmed current %v after its watch went silent: the watch was not replaced", watchReplaced)
		}
		time.Sleep(5 * time.Millisecond)
	}
	followed := time.Since(frozen)
	if r, _ := b.Lookup(host); !reflect.DeepEqual(r, second.Binding) {
		t.Fatalf("b's cache holds %+v once confirmed, want %+v", r, second.Binding)
	}
	t.Logf("b routed the takeover %v after its watch went silent (bound %v), its cache followed after %v",
		routed.Round(time.Millisecond), staleness, followed.Round(time.Millisecond))
	if routed > staleness+time.Second {
		t.Fatalf("b routed the takeover only after %v (bound %v)", routed, staleness)
	}
	for time.Since(frozen) < 3*time.Second { // b keeps its lease meanwhile
		if !b.Ready() {
			t.Fatal("b lost its lease with one of two paths silent")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := hb.count(func(h *hookLog) int { return h.lost }); n != 0 {
		t.Fatalf("b reported its lease lost %d times with one of two paths silent", n)
	}
}

// TestEtcdWatchReplacedAgain: node b reaches one etcd member by three
// paths; the one carrying its watch goes silent, and so does another.
// etcd's client holds a new watch until its member has created it, so a
// replacement that lands on a silent path must be ended too, a round
// later, for b's watch to reach the third path (or gRPC's keepalive to
// drop the silent ones) and deliver the change a made meanwhile. Nothing
// else brings it to b's cache: b reads nothing.
func TestEtcdWatchReplacedAgain(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	target := strings.TrimPrefix(cli[0], "http://")
	var paths []*tunneltest.FaultProxy
	var eps []string
	for range 3 {
		p := tunneltest.StartFaultProxy(t, target)
		t.Cleanup(p.Unblock) // before b's Close
		paths, eps = append(paths, p), append(eps, "http://"+p.Addr())
	}
	b := startNode(t, eps, prefix, "b", registry.Hooks{}, func(c *registry.EtcdConfig) {
		c.LeaseTTL, c.RouteStaleness, c.CallTimeout = 30*time.Second, 500*time.Millisecond, 150*time.Millisecond
	})
	a := startNode(t, cli, prefix, "a", registry.Hooks{})
	first, err := openBind(t, a, claim(instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "b to learn the first binding", func() bool { r, _ := b.Lookup(host); return reflect.DeepEqual(r, first.Binding) })
	w := slices.Index(paths, carrier(t, paths, prefix))
	paths[w].Block()
	paths[(w+1)%len(paths)].Block()
	frozen := time.Now()
	second, err := openBind(t, a, claim(instA, 2))
	if err != nil {
		t.Fatal(err)
	}
	// gRPC's keepalive (10 s and two call timeouts), with room for a
	// loaded machine.
	const replaced = 14 * time.Second
	for r, _ := b.Lookup(host); !reflect.DeepEqual(r, second.Binding); r, _ = b.Lookup(host) {
		if time.Since(frozen) > replaced {
			t.Fatalf("b's watch did not deliver the second binding within %v of two of its three paths going silent", replaced)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("b's watch delivered the second binding %v after two of its three paths went silent", time.Since(frozen).Round(time.Millisecond))
}

// carrier returns the path of paths that carries the watch: the one that
// brings back a large value written under prefix.
func carrier(t *testing.T, paths []*tunneltest.FaultProxy, prefix string) *tunneltest.FaultProxy {
	t.Helper()
	const probe = 256 << 10
	before := make([]int64, len(paths))
	for i, p := range paths {
		before[i] = p.Returned()
	}
	admin := etcdtest.Client(t)
	if _, err := admin.Put(context.Background(), prefix+"probe", strings.Repeat("x", probe)); err != nil {
		t.Fatal(err)
	}
	var found *tunneltest.FaultProxy
	eventually(t, "a path to carry the probe", func() bool {
		for i, p := range paths {
			if p.Returned()-before[i] >= probe {
				found = p
				return true
			}
		}
		return false
	})
	if _, err := admin.Delete(context.Background(), prefix+"probe"); err != nil {
		t.Fatal(err)
	}
	return found
}

// TestEtcdStraySessionRecord: a session record of this node that no open
// session owns (a put etcd applied after the edge had given up on it, and
// after the session closed) is removed within about a lease TTL; the
// records of open sessions stay.
func TestEtcdStraySessionRecord(t *testing.T) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	a := startNode(t, cli, prefix, "a", registry.Hooks{})
	ctx := context.Background()
	if err := a.OpenSession(ctx, registry.Session{ID: 1}); err != nil {
		t.Fatal(err)
	}
	admin := etcdtest.Client(t)
	if _, err := admin.Put(ctx, prefix+"sessions/a/99", "{}"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the stray record to be removed", func() bool {
		resp, err := admin.Get(ctx, prefix+"sessions/a/99")
		return err == nil && len(resp.Kvs) == 0
	})
	if got, err := a.Sessions(ctx); err != nil || len(got) != 1 || got[0].ID != 1 {
		t.Fatalf("sessions after the removal: %+v, %v; want the open one", got, err)
	}
}

// TestEtcdSessionOnHungMember: one of the three paths a node has to etcd
// hangs (open, silent), and sessions open one after another meanwhile. An
// attempt of a session record's put that went to the hung member costs a
// call timeout; the next must go elsewhere. Each put is given three call
// timeouts: the client's balancer, taking members in turn for every call,
// put attempt after attempt on the hung member, in step with the confirm
// rounds' reads (one put took 6.8 s of 1 s attempts). Sessions are opened
// for a third of gRPC's keepalive, which would drop the hung connection
// (10 s and more). About 4 s.
func TestEtcdSessionOnHungMember(t *testing.T) {
	const callTimeout = 300 * time.Millisecond
	a, paths, _ := threePathNode(t, 10*time.Second, callTimeout, 2*callTimeout)
	paths[0].Block()
	hung := time.Now()
	var slowest time.Duration
	for id := uint64(1); time.Since(hung) < 4*time.Second; id++ {
		ctx, cancel := context.WithTimeout(context.Background(), 3*callTimeout)
		start := time.Now()
		err := a.OpenSession(ctx, registry.Session{ID: id})
		cancel()
		if err != nil {
			t.Fatalf("session %d, %v into the hang: %v", id, start.Sub(hung).Round(time.Millisecond), err)
		}
		slowest = max(slowest, time.Since(start))
	}
	t.Logf("the slowest session record took %v (call timeout %v)", slowest.Round(time.Millisecond), callTimeout)
}

// TestEtcdReleaseOnHungMember: as TestEtcdSessionOnHungMember, for
// releases, whose delete is sent once per attempt and read back: each of
// ten is given five call timeouts. Through the client's balancer, a
// release's read and delete and a confirm round's read took three turns,
// so every delete went to the hung member: releases ran out their whole
// budget (ten call timeouts) with one member of three hung. About 3 s.
func TestEtcdReleaseOnHungMember(t *testing.T) {
	const callTimeout = 300 * time.Millisecond
	a, paths, _ := threePathNode(t, 10*time.Second, callTimeout, 2*callTimeout)
	var held []registry.Binding
	for i := range 10 {
		c := claim(instA, uint64(i+1))
		c.Hostname = fmt.Sprintf("r%d.example.com", i)
		res, err := openBind(t, a, c)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, res.Binding)
	}
	paths[0].Block()
	hung := time.Now()
	var slowest time.Duration
	for _, b := range held {
		ctx, cancel := context.WithTimeout(context.Background(), 5*callTimeout)
		start := time.Now()
		released, err := a.Release(ctx, b.Hostname, b.SessionID, b.Generation)
		cancel()
		if err != nil || !released {
			t.Fatalf("release of %s, %v into the hang: released %v, %v", b.Hostname, start.Sub(hung).Round(time.Millisecond), released, err)
		}
		slowest = max(slowest, time.Since(start))
	}
	t.Logf("the slowest release took %v (call timeout %v)", slowest.Round(time.Millisecond), callTimeout)
}

// threePathNode starts a node whose three members are three fault
// proxies to the shared etcd server, for the test to hang, with the given
// lease TTL, call timeout and route staleness; it returns the node, its
// paths and its prefix. The paths are unblocked before the node closes,
// so that it revokes its lease.
func threePathNode(t *testing.T, ttl, callTimeout, staleness time.Duration) (*registry.Etcd, []*tunneltest.FaultProxy, string) {
	var paths []*tunneltest.FaultProxy
	var eps []string
	for range 3 {
		p := tunneltest.StartFaultProxy(t, strings.TrimPrefix(etcdtest.Endpoints(t)[0], "http://"))
		paths, eps = append(paths, p), append(eps, "http://"+p.Addr())
	}
	prefix := etcdtest.Prefix(t)
	s := startNode(t, eps, prefix, "a", registry.Hooks{}, func(c *registry.EtcdConfig) {
		c.LeaseTTL, c.CallTimeout, c.RouteStaleness = ttl, callTimeout, staleness
	})
	for _, p := range paths {
		t.Cleanup(p.Unblock) // after startNode's, so before the node closes
	}
	return s, paths, prefix
}

// TestEtcdLeaseOnSlowMembers: every path a node has to an etcd with auth
// on turns slow: each call takes 500 ms, more than the call timeout (300
// ms), as an etcd overloaded, or a node starved, would answer. Renewals
// have no call timeout: answered late, they still count, and the lease
// must hold. About 6 s.
func TestEtcdLeaseOnSlowMembers(t *testing.T) {
	endpoints := etcdtest.StartSeparate(t)
	enableAuth(t, endpoints)
	var paths []*tunneltest.FaultProxy
	var eps []string
	for range 3 {
		p := tunneltest.StartFaultProxy(t, strings.TrimPrefix(endpoints[0], "http://"))
		paths, eps = append(paths, p), append(eps, "http://"+p.Addr())
	}
	var h hookLog
	a := startNode(t, eps, etcdtest.Prefix(t), "a", h.hooks(), func(c *registry.EtcdConfig) {
		c.Username, c.Password = "root", "rootpw"
		c.CallTimeout, c.RouteStaleness = 300*time.Millisecond, 600*time.Millisecond
	})
	for _, p := range paths {
		p.Slow(250 * time.Millisecond)
		t.Cleanup(func() { p.Slow(0) }) // before the node closes, so that it revokes its lease
	}
	slow := time.Now()
	for time.Since(slow) < 6*time.Second {
		if lost := h.count(func(h *hookLog) int { return h.lost }); lost != 0 || !a.Ready() {
			t.Fatalf("%v into every path's slowness, the node lost its lease (%d times): %v", time.Since(slow).Round(time.Millisecond), lost, h.lostError())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
