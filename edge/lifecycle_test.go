package edge_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// TestHelloThenVanish: 200 clients send a hello and drop their connection
// at once, racing the edge's registration of their session. Afterwards the
// edge holds only the sessions of the agents really connected, in memory
// and (in a cluster) in etcd, and a token limited to three sessions still
// lets three agents in. Half the clients use a token without a session
// limit: the limit would refuse most of them before the edge tries to
// send their hello_ok, whose failure is the path under test. In the
// cluster the edge reaches etcd through a proxy that slows every call
// while they vanish (a slow registry, as when the defect was found), so
// that they leave during the registry calls rather than before them.
func TestHelloThenVanish(t *testing.T) {
	for _, store := range tunneltest.Stores {
		t.Run(store, func(t *testing.T) {
			cfg := tunneltest.EdgeConfig(t)
			cfg.TokenPolicies = []edge.TokenPolicy{{Token: "three", MaxSessions: 3}, {Token: "open"}}
			cfg.AuthFailureLimit = 0
			// The agent that stays keeps the default liveness (a 15 s
			// heartbeat, 45 s to give up): it must not miss one while 200
			// handshakes load the machine, or its reconnect would count the
			// vanishing sessions against the token's limit.
			var slow *tunneltest.FaultProxy
			step := 200 * time.Microsecond // the vanishers' waits, in steps of
			if store == "etcd" {
				slow = tunneltest.StartFaultProxy(t, strings.TrimPrefix(etcdtest.Endpoints(t)[0], "http://"))
				step = 10 * time.Millisecond
			}
			var endpoints []string
			if slow != nil {
				endpoints = []string{"http://" + slow.Addr()}
			}
			tunneltest.UseStoreAt(t, &cfg, store, endpoints)
			e := tunneltest.StartEdge(t, cfg)
			b := tunneltest.StartBackend(t)
			stay := e.AgentConfig("", b.Addr())
			stay.Token, stay.Subdomain = "three", "stays"
			tunneltest.StartAgent(t, stay).WaitOnline(t)

			if slow != nil {
				slow.DelayExisting(50 * time.Millisecond) // each way: a call takes 100 ms more
			}
			var wg sync.WaitGroup
			for i := range 200 {
				token := map[bool]string{true: "three", false: "open"}[i%2 == 0]
				wg.Go(func() { helloAndVanish(t, e, token, time.Duration(i%10)*step, i%10 == 9) })
			}
			wg.Wait()
			if slow != nil {
				slow.DelayExisting(0)
			}
			waitSessions(t, e, cfg, 1)
			for _, name := range []string{"second", "third"} {
				ac := e.AgentConfig("", b.Addr())
				ac.Token, ac.Subdomain = "three", name
				tunneltest.StartAgent(t, ac).WaitOnline(t)
			}
			if n := e.Sessions(); n != 3 {
				t.Fatalf("%d sessions, want 3", n)
			}
		})
	}
}

// waitSessions waits until e has n sessions and, in a cluster, etcd has n
// too: an edge forgets an ended session before it tells etcd, and until
// then a bind ruled on etcd sees the session's holder alive.
func waitSessions(t *testing.T, e *tunneltest.Edge, cfg edge.Config, n int) {
	t.Helper()
	tunneltest.Eventually(t, 10*time.Second, fmt.Sprintf("%d sessions left", n), func() bool { return e.Sessions() == n })
	if cfg.Cluster != nil {
		etcd := cfg.Cluster.Store.(*registry.Etcd)
		tunneltest.Eventually(t, 10*time.Second, fmt.Sprintf("%d sessions left in etcd", n), func() bool {
			ss, err := etcd.Sessions(context.Background())
			return err == nil && len(ss) == n
		})
	}
}

// helloAndVanish sends a hello and closes the connection after wait, or
// once the edge has answered: the close lands anywhere in the edge's
// registration of the session.
func helloAndVanish(t *testing.T, e *tunneltest.Edge, token string, wait time.Duration, waitAnswer bool) {
	c, err := tls.Dial("tcp", e.Addr("control").String(), &tls.Config{RootCAs: e.Roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
	if err != nil {
		return // the handshake outlived the hello timeout on a loaded machine: vanished all the same
	}
	defer c.Close()
	ys, err := yamux.Client(c, nil)
	if err != nil {
		t.Error(err)
		return
	}
	defer ys.Close()
	ctrl, err := ys.OpenStream()
	if err != nil {
		return
	}
	mux.Write(ctrl, &mux.Hello{Version: mux.Version, InstanceID: agent.NewInstanceID(), Token: token})
	time.Sleep(wait)
	if waitAnswer {
		ctrl.SetReadDeadline(time.Now().Add(5 * time.Second))
		mux.Read(ctrl)
	}
}

// flakyStore fails its next Release calls.
type flakyStore struct {
	registry.Store
	failures atomic.Int32
	failed   atomic.Int32
}

func (s *flakyStore) Release(ctx context.Context, host string, session, gen uint64) (bool, error) {
	if s.failures.Add(-1) >= 0 {
		s.failed.Add(1)
		return false, errors.New("injected: etcdserver: leader changed")
	}
	return s.Store.Release(ctx, host, session, gen)
}

// TestFailedReleaseRetried: a release that fails (the registry did not
// answer) is tried again, after a graceful unbind and after a session
// that ended without one: the name then answers 404, not 503 forever.
func TestFailedReleaseRetried(t *testing.T) {
	for _, graceful := range []bool{true, false} {
		name := map[bool]string{true: "unbind", false: "session ended"}[graceful]
		t.Run(name, func(t *testing.T) {
			store := &flakyStore{Store: registry.NewMemory(nil)}
			cfg := tunneltest.EdgeConfig(t)
			cfg.Store = store
			cfg.HeartbeatTimeout = 300 * time.Millisecond
			e := tunneltest.StartEdge(t, cfg)
			b := tunneltest.StartBackend(t)
			ac := e.AgentConfig("", b.Addr())
			ac.Subdomain = "flaky"
			ac.HeartbeatInterval, ac.HeartbeatTimeout = 50*time.Millisecond, 250*time.Millisecond
			var p *tunneltest.FaultProxy
			if !graceful {
				p = tunneltest.StartFaultProxy(t, e.Addr("control").String())
				ac.Edge = p.Addr()
			}
			a := tunneltest.StartAgent(t, ac)
			a.WaitOnline(t)
			store.failures.Store(1)
			if graceful {
				a.Stop()
			} else {
				p.Block()
				p.Reset()
				a.Stop()
			}
			c := e.Client()
			tunneltest.Eventually(t, 10*time.Second, "the name released (404)", func() bool {
				resp, err := c.Get(tunneltest.URL("http", "flaky", "/hello"))
				if err != nil {
					return false
				}
				resp.Body.Close()
				return resp.StatusCode == http.StatusNotFound && resp.Header.Get(mux.ErrorHeader) == mux.CodeTunnelNotFound
			})
			if store.failed.Load() != 1 {
				t.Fatalf("%d releases failed, want the 1 injected", store.failed.Load())
			}
		})
	}
}

// TestCloseRightAfterStart: an edge closed as soon as it has started waits
// for every goroutine its listeners started, the TLS terminator's accept
// loop among them (the race detector saw Close's wait run before that
// loop was counted).
func TestCloseRightAfterStart(t *testing.T) {
	for range 200 {
		e, err := edge.New(tunneltest.EdgeConfig(t), tunneltest.Logger())
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		e.Close()
	}
}
