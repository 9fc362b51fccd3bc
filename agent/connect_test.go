package agent_test

import (
	"crypto/tls"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// attemptEdge is a played edge that accepts each of a connect's attempts
// as the test says: a bare TCP connection, or TLS and yamux up to the
// control stream.
type attemptEdge struct {
	t   *testing.T
	ln  net.Listener
	tls *tls.Config
}

func startAttemptEdge(t *testing.T) (*attemptEdge, agent.Config) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	cfg := agent.DefaultConfig()
	cfg.Subdomain, cfg.Local = "app", "127.0.0.1:1"
	cfg.Edge, cfg.Insecure = ln.Addr().String(), true
	cfg.DialTimeout, cfg.BackoffBase, cfg.BackoffCap = 10*time.Second, time.Hour, time.Hour
	return &attemptEdge{t: t, ln: ln, tls: selfSigned(t)}, cfg
}

// next accepts the next attempt's TCP connection, within 10 s.
func (e *attemptEdge) next() net.Conn {
	e.t.Helper()
	e.ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * time.Second))
	c, err := e.ln.Accept()
	if err != nil {
		e.t.Fatalf("no attempt came: %v", err)
	}
	e.t.Cleanup(func() { c.Close() })
	return c
}

// session runs TLS and yamux on c and returns the control stream, whose
// reads fail after 10 s.
func (e *attemptEdge) session(c net.Conn) *yamux.Stream {
	e.t.Helper()
	yc, err := mux.DefaultConfig().Yamux(nil)
	if err != nil {
		e.t.Fatal(err)
	}
	ys, err := yamux.Server(tls.Server(c, e.tls), yc)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { ys.Close() })
	ctrl, err := ys.AcceptStream()
	if err != nil {
		e.t.Fatal(err)
	}
	ctrl.SetDeadline(time.Now().Add(10 * time.Second))
	return ctrl
}

// expect reads the next control message and checks its type.
func expect(t *testing.T, ctrl *yamux.Stream, want mux.Type) {
	t.Helper()
	m, err := mux.Read(ctrl)
	if err != nil || m.MessageType() != want {
		t.Fatalf("read %v (%v), want %s", m, err, want)
	}
}

// closedWithin reports whether the agent closes ctrl's session within d,
// sending nothing more on it.
func closedWithin(t *testing.T, ctrl *yamux.Stream, d time.Duration) bool {
	t.Helper()
	ctrl.SetReadDeadline(time.Now().Add(d))
	m, err := mux.Read(ctrl)
	if err == nil {
		t.Fatalf("the agent sent %s", m.MessageType())
	}
	var ne net.Error
	return !errors.As(err, &ne) || !ne.Timeout()
}

// TestConnectBindsOneAttemptAtATime: a connect's second attempt, started
// while the first waits for its binds' answers, gets as far as the hello
// and sends no bind; when the first is answered it is the session, and the
// second is closed. Two attempts' binds out at once would race at the
// edge, where the later takes the name from the earlier.
func TestConnectBindsOneAttemptAtATime(t *testing.T) {
	e, cfg := startAttemptEdge(t)
	a := tunneltest.StartAgent(t, cfg)
	first := e.session(e.next())
	expect(t, first, mux.TypeHello)
	expect(t, first, mux.TypeBind)

	second := e.session(e.next()) // a second later: no round trip measured yet
	expect(t, second, mux.TypeHello)
	mux.Write(second, &mux.HelloOK{SessionID: 2})
	if closedWithin(t, second, 300*time.Millisecond) {
		t.Fatal("the second attempt ended before the first was answered")
	}

	mux.Write(first, &mux.HelloOK{SessionID: 1})
	mux.Write(first, &mux.BindOK{Hostname: "app.example.net", URL: "https://app.example.net", Generation: 1})
	if st := a.WaitOnline(t); st.SessionID != 1 {
		t.Fatalf("online on session %d, want the first attempt's, 1", st.SessionID)
	}
	if !closedWithin(t, second, 5*time.Second) {
		t.Fatal("the losing attempt was left open")
	}
}

// TestConnectPassesBindingOn: an attempt whose binds go unanswered for its
// whole life is closed, and the next attempt sends its own binds and
// becomes the session; the first attempt, whose TLS handshake never got an
// answer, is closed with it.
func TestConnectPassesBindingOn(t *testing.T) {
	e, cfg := startAttemptEdge(t)
	a := tunneltest.StartAgent(t, cfg)
	first := e.next() // its TLS handshake waits until the connect ends

	second := e.session(e.next())
	expect(t, second, mux.TypeHello)
	expect(t, second, mux.TypeBind)
	if !closedWithin(t, second, 5*time.Second) {
		t.Fatal("an attempt past its life was left open")
	}

	third := e.session(e.next())
	expect(t, third, mux.TypeHello)
	expect(t, third, mux.TypeBind)
	mux.Write(third, &mux.HelloOK{SessionID: 3})
	mux.Write(third, &mux.BindOK{Hostname: "app.example.net", URL: "https://app.example.net", Generation: 1})
	if st := a.WaitOnline(t); st.SessionID != 3 {
		t.Fatalf("online on session %d, want the third attempt's", st.SessionID)
	}
	first.SetReadDeadline(time.Now().Add(5 * time.Second))
	for buf := make([]byte, 4096); ; {
		if _, err := first.Read(buf); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatal("the first attempt was left open")
			}
			break
		}
	}
}

// TestEdgeGivesTheLaterBind: what the edge does with two sessions of one
// instance that bind the same name, which a connect's attempts must not
// do at once: the later bind wins, the earlier session is told it was
// taken over by its own instance and, holding nothing else, closed; the
// name stays with the later session.
func TestEdgeGivesTheLaterBind(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfigShortTimeouts(t))
	hello := &mux.Hello{Version: mux.Version, InstanceID: agent.NewInstanceID(), Agent: "test"}
	host := "race." + tunneltest.Domain
	var sessions [2]*tunneltest.RawSession
	var ids, gens [2]uint64
	for i := range sessions {
		r, m := e.DialRaw(t, hello)
		ok, isOK := m.(*mux.HelloOK)
		if !isOK {
			t.Fatalf("hello %d: %+v", i, m)
		}
		b, isOK := r.Bind(t, &mux.Bind{Subdomain: "race", Takeover: true}).(*mux.BindOK)
		if !isOK {
			t.Fatalf("bind %d refused", i)
		}
		sessions[i], ids[i], gens[i] = r, ok.SessionID, b.Generation
	}
	if gens[1] <= gens[0] {
		t.Fatalf("generations %v, want the later higher", gens)
	}
	ev, ok := sessions[0].Read(t).(*mux.Evicted)
	if !ok || ev.Hostname != host || ev.Reason != mux.ReasonTakeover || ev.By == nil || ev.By.Instance != mux.InstanceDigest(hello.InstanceID) {
		t.Fatalf("the earlier session got %+v, want evicted by its own instance", ev)
	}
	select {
	case <-sessions[0].YS.CloseChan():
	case <-time.After(5 * time.Second):
		t.Fatal("the edge kept the earlier session, which holds nothing")
	}
	tn := tunnel(t, e, host)
	if tn.SessionID != ids[1] || tn.Generation != gens[1] || !tn.Online {
		t.Fatalf("the edge's view %+v, want session %d at generation %d", tn, ids[1], gens[1])
	}
}
