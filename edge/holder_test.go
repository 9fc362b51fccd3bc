package edge_test

import (
	"strings"
	"testing"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestEvictedNamesTheHolder: an agent that loses its name (evicted) or is
// refused it (subdomain_taken) is told who holds it when that agent
// presented the same token: its instance digest and address as the edge
// saw it. An agent of another token, whether it asks for the name or lost
// it to the holder, learns only that the holder has another token: nothing
// of the holder's reaches it. On one edge and on etcd.
func TestEvictedNamesTheHolder(t *testing.T) {
	for _, store := range tunneltest.Stores {
		t.Run(store, func(t *testing.T) { testEvictedNamesTheHolder(t, store) })
	}
}

func testEvictedNamesTheHolder(t *testing.T, store string) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.Tokens = []string{"alpha", "beta"}
	tunneltest.UseStore(t, &cfg, store)
	e := tunneltest.StartEdge(t, cfg)
	id := agent.NewInstanceID()
	mine := &mux.Hello{Version: mux.Version, InstanceID: id, Token: "alpha"}
	first := dialBound(t, e, mine, "named")
	// The same instance again, from another connection: it takes the name
	// over, and the first session is told by whom.
	second := dialBound(t, e, mine, "named")
	addr := second.YS.LocalAddr().String()
	holder := mux.Holder{Instance: mux.InstanceDigest(id), Addr: addr}
	ev, ok := first.Read(t).(*mux.Evicted)
	if !ok || ev.By == nil || *ev.By != holder {
		t.Fatalf("the evicted session was told %+v, want by %+v", ev, holder)
	}

	// Another agent of the same token asking for it: refused, told who.
	if by := refusedBy(t, e, hello("alpha"), "named", addr, id); by == nil || *by != holder {
		t.Errorf("an agent of the same token, refused, was told %+v, want %+v", by, holder)
	}
	// One of another token: told only that.
	if by := refusedBy(t, e, hello("beta"), "named", addr, id); by == nil || *by != (mux.Holder{OtherToken: true}) {
		t.Errorf("an agent of another token, refused, was told %+v, want only other_token", by)
	}

	// The holder goes; an agent of another token takes the name, and the
	// holder, back, is refused it without a word of the agent that has it.
	second.YS.Close()
	waitSessions(t, e, cfg, 1)
	taker := &mux.Hello{Version: mux.Version, InstanceID: agent.NewInstanceID(), Token: "beta"}
	takerRaw := dialBound(t, e, taker, "named")
	if by := refusedBy(t, e, mine, "named", takerRaw.YS.LocalAddr().String(), taker.InstanceID); by == nil || *by != (mux.Holder{OtherToken: true}) {
		t.Errorf("the holder back, refused, was told %+v of an agent of another token, want only other_token", by)
	}
}

// dialBound opens a session with h and binds sub (with takeover), failing
// the test when refused.
func dialBound(t *testing.T, e *tunneltest.Edge, h *mux.Hello, sub string) *tunneltest.RawSession {
	t.Helper()
	r, m := e.DialRaw(t, h)
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %+v", m)
	}
	if m, ok := r.Bind(t, &mux.Bind{Subdomain: sub, Takeover: true}).(*mux.BindOK); !ok {
		t.Fatalf("bind %s: %+v", sub, m)
	}
	return r
}

// refusedBy binds sub in a session of h, wants subdomain_taken, and
// returns what it said of the holder. Its message must not name the
// holder's address or instance (id, or the digest of it) either way: the
// holder is told of only in by.
func refusedBy(t *testing.T, e *tunneltest.Edge, h *mux.Hello, sub, holderAddr, holderID string) *mux.Holder {
	t.Helper()
	r, m := e.DialRaw(t, h)
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %+v", m)
	}
	be, ok := r.Bind(t, &mux.Bind{Subdomain: sub, Takeover: true}).(*mux.BindError)
	if !ok || be.Code != mux.CodeSubdomainTaken {
		t.Fatalf("bind %s: %+v, want %s", sub, be, mux.CodeSubdomainTaken)
	}
	for _, secret := range []string{holderAddr, holderID, mux.InstanceDigest(holderID)} {
		if strings.Contains(be.Message, secret) {
			t.Errorf("the refusal's message %q names the holder (%s)", be.Message, secret)
		}
	}
	r.YS.Close()
	return be.By
}

// TestClusterEvictedNamesRemoteHolder: in a cluster, a session whose name
// is taken over through another edge is told the holder's instance, and
// no address: its edge does not know the other's agents'.
func TestClusterEvictedNamesRemoteHolder(t *testing.T) {
	c := newTestCluster(t)
	tokens := func(cfg *edge.Config) { cfg.Tokens = []string{"alpha"} }
	a, b := c.start("a", nil, tokens), c.start("b", nil, tokens)
	mine := hello("alpha")
	first := dialBound(t, a.Edge, mine, "moving")
	dialBound(t, b.Edge, mine, "moving")
	ev, ok := first.Read(t).(*mux.Evicted)
	if want := (mux.Holder{Instance: mux.InstanceDigest(mine.InstanceID)}); !ok || ev.By == nil || *ev.By != want {
		t.Fatalf("the session on edge a was told %+v, want by %+v", ev, want)
	}
}
