package agent_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// eachStore runs an ownership test on each registry: the binding rules
// must hold the same on one edge's memory and on etcd.
func eachStore(t *testing.T, test func(t *testing.T, store string)) {
	for _, store := range tunneltest.Stores {
		t.Run(store, func(t *testing.T) { test(t, store) })
	}
}

// edgeConfig is an edge on store with short timeouts, as the ownership
// tests' agents (AgentConfigShortTimeouts) have.
func edgeConfig(t *testing.T, store string) edge.Config {
	cfg := tunneltest.EdgeConfigShortTimeouts(t)
	tunneltest.UseStore(t, &cfg, store)
	return cfg
}

func newProxy(t *testing.T, e *tunneltest.Edge) *tunneltest.FaultProxy {
	return tunneltest.StartFaultProxy(t, e.Addr("control").String())
}

func tunnel(t *testing.T, e *tunneltest.Edge, host string) edge.Tunnel {
	t.Helper()
	ts, err := e.Tunnels(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range ts {
		if tn.Hostname == host {
			return tn
		}
	}
	t.Fatalf("no tunnel %s in %+v", host, ts)
	return edge.Tunnel{}
}

// quickGet does one bounded GET and reports its status (0 on error).
func quickGet(c *http.Client, url string) (int, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	resp, err := c.Do(req)
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestPartitionGetsNameBack: the path goes silent while the edge still
// believes the old session live; when the network returns, the same agent
// has its name back at once, with the same instance, a new session and a
// higher generation, without waiting for the edge's detection window.
func TestPartitionGetsNameBack(t *testing.T) { eachStore(t, testPartitionGetsNameBack) }

func testPartitionGetsNameBack(t *testing.T, store string) {
	b := tunneltest.StartBackend(t)
	cfg := edgeConfig(t, store)
	cfg.HeartbeatTimeout = time.Minute // the edge will not notice the partition
	e := tunneltest.StartEdge(t, cfg)
	p := newProxy(t, e)
	ac := e.AgentConfigShortTimeouts(p.Addr(), b.Addr())
	ac.Subdomain = "part"
	ac.HeartbeatTimeout = 300 * time.Millisecond
	ac.DialTimeout = 500 * time.Millisecond
	ac.BackoffBase = 500 * time.Millisecond // production default
	ac.BackoffCap = 30 * time.Second
	a := tunneltest.StartAgent(t, ac)
	before := a.WaitOnline(t)
	host := "part." + tunneltest.Domain

	p.Block()
	a.WaitStatus(t, 5*time.Second, "the agent to notice", func(s agent.Status) bool { return s.State == agent.StateReconnecting })
	time.Sleep(time.Second) // the partition lasts a while (this is the fault, not a wait for a condition)
	if tn := tunnel(t, e, host); !tn.Online || tn.SessionID != before.SessionID {
		t.Fatalf("the edge should still believe the zombie live: %+v", tn)
	}

	p.Unblock()
	back := time.Now()
	c := e.Client()
	tunneltest.Eventually(t, 5*time.Second, "a visitor request to succeed", func() bool {
		code, _ := quickGet(c, tunneltest.URL("https", "part", "/hello"))
		return code == 200
	})
	took := time.Since(back)
	t.Logf("network return to first successful visitor request: %s", took.Round(time.Millisecond))

	tn := tunnel(t, e, host)
	if tn.InstanceID != mux.InstanceDigest(a.InstanceID()) || tn.SessionID == before.SessionID || tn.Generation <= before.Generation || !tn.Online {
		t.Fatalf("after return: %+v; before: session %d generation %d instance %s", tn, before.SessionID, before.Generation, a.InstanceID())
	}
	if took > 5*time.Second {
		t.Errorf("took %s to serve again", took)
	}
}

func TestDifferentAgentRefusedWhileLive(t *testing.T) {
	eachStore(t, testDifferentAgentRefusedWhileLive)
}

func testDifferentAgentRefusedWhileLive(t *testing.T, store string) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, edgeConfig(t, store))
	first := e.AgentConfigShortTimeouts("", b.Addr())
	first.Subdomain = "taken"
	a := tunneltest.StartAgent(t, first)
	a.WaitOnline(t)
	b2 := tunneltest.StartBackend(t)
	ac := e.AgentConfigShortTimeouts("", b2.Addr())
	ac.Subdomain = "taken"
	other := tunneltest.StartAgent(t, ac)
	err := other.Err()
	var re *agent.RefusedError
	if !errors.As(err, &re) || re.Code != mux.CodeSubdomainTaken || re.Message == "" {
		t.Fatalf("second agent: err %v, want subdomain_taken with a message", err)
	}
	if st := other.Status(); st.State != agent.StateFailed {
		t.Errorf("second agent state %s", st.State)
	}
	if tn := tunnel(t, e, "taken."+tunneltest.Domain); tn.InstanceID != mux.InstanceDigest(a.InstanceID()) {
		t.Errorf("holder changed: %+v", tn)
	}
}

// TestStaleHolderTakenOver: the holder goes silent; once the edge sees it
// dead, a different agent takes the name. When the old holder wakes up it
// exits with a final error naming the agent that took the name, and its
// cleanup leaves the new binding alone.
func TestStaleHolderTakenOver(t *testing.T) { eachStore(t, testStaleHolderTakenOver) }

func testStaleHolderTakenOver(t *testing.T, store string) {
	b := tunneltest.StartBackend(t)
	cfg := edgeConfig(t, store)
	cfg.HeartbeatTimeout = 300 * time.Millisecond
	e := tunneltest.StartEdge(t, cfg)
	p := newProxy(t, e)
	ac := e.AgentConfigShortTimeouts(p.Addr(), b.Addr())
	ac.Subdomain = "stale"
	ac.HeartbeatTimeout = time.Minute // frozen: it does not notice anything
	old := tunneltest.StartAgent(t, ac)
	old.WaitOnline(t)
	host := "stale." + tunneltest.Domain

	p.Block()
	tunneltest.Eventually(t, 5*time.Second, "the holder to be seen dead", func() bool {
		return !tunnel(t, e, host).Online
	})
	nc := e.AgentConfigShortTimeouts("", b.Addr())
	nc.Subdomain = "stale"
	newer := tunneltest.StartAgent(t, nc)
	st := newer.WaitOnline(t)

	p.Unblock()
	select {
	case <-old.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the woken old holder did not exit")
	}
	// Evicted, whether the edge told it so or refused its return because
	// the name is another's now.
	if err := old.Err(); !errors.Is(err, agent.ErrEvicted) {
		t.Fatalf("old holder exited with %v, want evicted", err)
	}
	if st := old.Status(); st.State != agent.StateEvicted || st.EvictedReason == "" {
		t.Errorf("old holder's status: %s, reason %q", st.State, st.EvictedReason)
	}
	// Told which agent holds the name: by its instance only, as the edge
	// takes no tokens (no account to tell its agents' addresses to).
	by := mux.Holder{Instance: mux.InstanceDigest(newer.InstanceID())}
	if st := old.Status(); st.EvictedBy != by || st.Tunnels[0].EvictedBy != by || !strings.Contains(old.Err().Error(), "by "+by.String()) {
		t.Errorf("old holder told %+v (its tunnel %+v, its error %q), want %+v", st.EvictedBy, st.Tunnels[0].EvictedBy, old.Err(), by)
	}
	if s := old.Status(); s.URL != "" {
		t.Errorf("old holder still advertises %s", s.URL)
	}
	// Its session is gone from the edge and its offline grace has passed:
	// the new binding must be intact.
	tunneltest.Eventually(t, 5*time.Second, "the old session to be gone", func() bool { return e.Sessions() == 1 })
	time.Sleep(2 * cfg.HeartbeatTimeout) // past the offline grace of the old session's bindings
	tn := tunnel(t, e, host)
	if tn.InstanceID != mux.InstanceDigest(newer.InstanceID()) || tn.Generation != st.Generation || !tn.Online {
		t.Fatalf("new owner's binding disturbed: %+v (want generation %d)", tn, st.Generation)
	}
	if code, _ := quickGet(e.Client(), tunneltest.URL("https", "stale", "/hello")); code != 200 {
		t.Fatalf("new owner not serving: %d", code)
	}
}

// TestInFlightSurvivesTakeover: the old path's bytes are delayed past the
// agent's heartbeat timeout, so it reconnects on a new path and takes its
// name over while a request accepted on the old session is still being
// served: its response is written only once the takeover is done, and
// reaches the visitor on the old session, delayed.
func TestInFlightSurvivesTakeover(t *testing.T) { eachStore(t, testInFlightSurvivesTakeover) }

func testInFlightSurvivesTakeover(t *testing.T, store string) {
	// The drains are bounds, not waits: long enough for a takeover on a
	// loaded machine (dial, TLS, a bind through etcd) and the delayed path.
	const drain = 15 * time.Second
	b := tunneltest.StartBackend(t)
	cfg := edgeConfig(t, store)
	cfg.HeartbeatTimeout = time.Minute
	cfg.DrainTimeout = drain
	e := tunneltest.StartEdge(t, cfg)
	p := newProxy(t, e)
	ac := e.AgentConfigShortTimeouts(p.Addr(), b.Addr())
	ac.Subdomain = "flight"
	ac.HeartbeatTimeout = 300 * time.Millisecond
	ac.DrainTimeout = drain
	a := tunneltest.StartAgent(t, ac)
	first := a.WaitOnline(t)

	type result struct {
		code int
		body string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := e.Client().Get(tunneltest.URL("https", "flight", "/slow"))
		if err != nil {
			done <- result{err: err}
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- result{code: resp.StatusCode, body: string(body)}
	}()
	<-b.Entered
	p.DelayExisting(500 * time.Millisecond)
	// Released only after the takeover: a release before it would race
	// the takeover (its time under load) against the delay.
	second := a.WaitStatus(t, 10*time.Second, "a takeover on a new session", func(s agent.Status) bool {
		return s.State == agent.StateOnline && s.Generation > first.Generation
	})
	b.Release()
	r := <-done
	if r.err != nil || r.code != 200 || r.body != "slow done" {
		t.Fatalf("in-flight request: %d %q %v", r.code, r.body, r.err)
	}
	if second.SessionID == first.SessionID {
		t.Fatal("no new session")
	}
}

// TestRepeatedResets: 30 resets in a row leave one session and one
// binding, and no goroutine growth.
func TestRepeatedResets(t *testing.T) { eachStore(t, testRepeatedResets) }

func testRepeatedResets(t *testing.T, store string) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, edgeConfig(t, store))
	p := newProxy(t, e)
	ac := e.AgentConfigShortTimeouts(p.Addr(), b.Addr())
	ac.Subdomain = "resets"
	a := tunneltest.StartAgent(t, ac)
	st := a.WaitOnline(t)
	c := e.Client()
	var base int
	for i := range 30 {
		p.Reset()
		prev := st.SessionID
		st = a.WaitStatus(t, 10*time.Second, "online on a new session", func(s agent.Status) bool {
			return s.State == agent.StateOnline && s.SessionID != prev
		})
		if i == 0 {
			tunneltest.Eventually(t, 5*time.Second, "one session", func() bool { return e.Sessions() == 1 })
			// The agent keeps a connection to the local service (two
			// goroutines of net/http's) once it has served a request.
			if code, _ := quickGet(c, tunneltest.URL("https", "resets", "/hello")); code != 200 {
				t.Fatalf("not serving: %d", code)
			}
			c.CloseIdleConnections()
			base = tunneltest.Goroutines()
		}
	}
	tunneltest.Eventually(t, 5*time.Second, "exactly one session", func() bool { return e.Sessions() == 1 })
	ts, _ := e.Tunnels(context.Background())
	if len(ts) != 1 || ts[0].SessionID != st.SessionID || !ts[0].Online {
		t.Fatalf("tunnels after resets: %+v (agent session %d)", ts, st.SessionID)
	}
	if code, _ := quickGet(c, tunneltest.URL("https", "resets", "/hello")); code != 200 {
		t.Fatalf("not serving after resets: %d", code)
	}
	c.CloseIdleConnections()
	tunneltest.Eventually(t, 5*time.Second, "goroutines back to their level", func() bool {
		return tunneltest.Goroutines() <= base+5
	})
}

func dialRaw(t *testing.T, e *tunneltest.Edge, instance string) *tunneltest.RawSession {
	t.Helper()
	r, m := e.DialRaw(t, &mux.Hello{Version: mux.Version, InstanceID: instance})
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	return r
}

// TestSameInstanceRace: two sessions of one instance bind one name at the
// same time: both succeed (no subdomain_taken), the later generation owns
// it, and the other session is told it was evicted.
func TestSameInstanceRace(t *testing.T) { eachStore(t, testSameInstanceRace) }

func testSameInstanceRace(t *testing.T, store string) {
	e := tunneltest.StartEdge(t, edgeConfig(t, store))
	id := agent.NewInstanceID()
	for round := range 20 {
		s1, s2 := dialRaw(t, e, id), dialRaw(t, e, id)
		oks := make([]*mux.BindOK, 2)
		var wg sync.WaitGroup
		for i, s := range []*tunneltest.RawSession{s1, s2} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				mux.Write(s.Ctrl, &mux.Bind{Subdomain: "race", Takeover: true})
				for {
					m, err := mux.Read(s.Ctrl)
					if err != nil {
						return
					}
					switch m := m.(type) {
					case *mux.BindOK:
						oks[i] = m
						return
					case *mux.BindError:
						t.Errorf("round %d: session %d refused: %s", round, i, m.Code)
						return
					}
				}
			}()
		}
		wg.Wait()
		if oks[0] == nil || oks[1] == nil {
			t.Fatalf("round %d: binds %+v", round, oks)
		}
		loser := s1
		if oks[0].Generation > oks[1].Generation {
			loser = s2
		}
		loser.Ctrl.SetReadDeadline(time.Now().Add(5 * time.Second))
		m, err := mux.Read(loser.Ctrl)
		ev, ok := m.(*mux.Evicted)
		if err != nil || !ok || ev.Hostname != "race."+tunneltest.Domain || ev.Reason != mux.ReasonTakeover {
			t.Fatalf("round %d: loser got %v %v, want evicted", round, m, err)
		}
		tn := tunnel(t, e, "race."+tunneltest.Domain)
		if want := max(oks[0].Generation, oks[1].Generation); tn.Generation != want {
			t.Fatalf("round %d: owner generation %d, want %d", round, tn.Generation, want)
		}
		s1.YS.Close()
		s2.YS.Close()
	}
}

// TestShownInstanceCannotTakeName: everything the admin API and the
// agent's own logs show of an instance (its digest), presented in a hello
// with the agent's token, does not take a live name over: the edge refuses
// subdomain_taken. The agent's own reconnect still takes it back at once.
func TestShownInstanceCannotTakeName(t *testing.T) { eachStore(t, testShownInstanceCannotTakeName) }

func testShownInstanceCannotTakeName(t *testing.T, store string) {
	b := tunneltest.StartBackend(t)
	cfg := edgeConfig(t, store)
	cfg.Tokens = []string{"shared"}
	e := tunneltest.StartEdge(t, cfg)
	p := newProxy(t, e)
	var logs lockedBuffer
	ac := e.AgentConfigShortTimeouts(p.Addr(), b.Addr())
	ac.Subdomain, ac.Token, ac.LogRequests = "mine", "shared", true
	a := tunneltest.StartAgentLogged(t, ac, slog.New(slog.NewJSONHandler(&logs, nil)))
	a.WaitOnline(t)
	quickGet(e.Client(), tunneltest.URL("https", "mine", "/hello"))

	shown := tunnel(t, e, "mine."+tunneltest.Domain).InstanceID
	logged := logs.String
	// The request's line is logged once its response has gone.
	tunneltest.Eventually(t, 10*time.Second, "the request's line", func() bool { return strings.Contains(logged(), `"path":"/hello"`) })
	if l := logged(); strings.Contains(l, a.InstanceID()) || !strings.Contains(l, shown) || shown == a.InstanceID() || a.Status().InstanceID != shown {
		t.Fatalf("the instance id is shown: admin %s, status %s, logs contain the id %v, the digest %v", shown, a.Status().InstanceID, strings.Contains(l, a.InstanceID()), strings.Contains(l, shown))
	}
	r, m := e.DialRaw(t, &mux.Hello{Version: mux.Version, InstanceID: shown, Token: "shared"})
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	if got := r.Bind(t, &mux.Bind{Subdomain: "mine", Takeover: true}); got.(*mux.BindError).Code != mux.CodeSubdomainTaken {
		t.Fatalf("a hello with the shown digest took the name: %+v", got)
	}
	before := tunnel(t, e, "mine."+tunneltest.Domain)
	p.Reset()
	tunneltest.Eventually(t, 10*time.Second, "the agent back on a new session", func() bool {
		st := a.Status()
		return st.State == agent.StateOnline && st.SessionID != before.SessionID
	})
	if after := tunnel(t, e, "mine."+tunneltest.Domain); after.InstanceID != shown || after.Generation <= before.Generation {
		t.Fatalf("after the reconnect: %+v, before %+v", after, before)
	}
}
