package agent_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// playedEdge is an edge the test answers itself: the yamux session of the
// agent's one connection, and its control stream.
type playedEdge struct {
	ys   *yamux.Session
	ctrl *yamux.Stream
}

// playEdge starts an agent with cfg (its edge, local service and timeouts
// set here; Local where cfg has none) against a TLS listener the test
// answers, and returns the agent and its connection once the control
// stream is open. Nothing is read from it yet.
func playEdge(t *testing.T, cfg agent.Config) (*tunneltest.Agent, *playedEdge) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", selfSigned(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	cfg.Edge, cfg.Insecure = ln.Addr().String(), true
	if cfg.Local == "" {
		cfg.Local = "127.0.0.1:1"
	}
	cfg.DialTimeout, cfg.BackoffBase, cfg.BackoffCap = 10*time.Second, time.Hour, time.Hour
	a := tunneltest.StartAgent(t, cfg)
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	yc, err := mux.DefaultConfig().Yamux(nil)
	if err != nil {
		t.Fatal(err)
	}
	ys, err := yamux.Server(c, yc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ys.Close() })
	ctrl, err := ys.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	return a, &playedEdge{ys: ys, ctrl: ctrl}
}

// startPlayedEdge starts an agent of "app" against a played edge, which
// lists features in its hello_ok and grants the bind.
func startPlayedEdge(t *testing.T, local string, features ...string) *playedEdge {
	t.Helper()
	cfg := agent.DefaultConfig()
	cfg.Local, cfg.Subdomain = local, "app"
	a, e := playEdge(t, cfg)
	e.ctrl.SetDeadline(time.Now().Add(20 * time.Second))
	for _, want := range []mux.Type{mux.TypeHello, mux.TypeBind} {
		if m, err := mux.Read(e.ctrl); err != nil || m.MessageType() != want {
			t.Fatalf("read %v (%v), want %s", m, err, want)
		}
	}
	mux.Write(e.ctrl, &mux.HelloOK{SessionID: 1, Features: features})
	mux.Write(e.ctrl, &mux.BindOK{Hostname: "app.example.net", URL: "https://app.example.net", Generation: 1})
	e.ctrl.SetDeadline(time.Time{})
	a.WaitOnline(t)
	return e
}

// accept waits up to d for a stream the agent opens; nil if none came.
func (e *playedEdge) accept(t *testing.T, d time.Duration) *yamux.Stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	st, err := e.ys.AcceptStreamWithContext(ctx)
	if err != nil {
		return nil
	}
	return st
}

// TestStreamsStayOpen: the agent serves one stream's exchanges one after
// another, each its own answer, uploads the local service reads before it
// answers among them, and opens no stream towards the edge, not even for
// an edge of the version before that listed "spare-stream" (the agent
// then kept a stream open towards it for large uploads).
func TestStreamsStayOpen(t *testing.T) {
	b := tunneltest.StartBackend(t)
	const size = 1 << 20
	upload := fmt.Sprintf("POST /sink HTTP/1.1\r\nHost: app.example.net\r\nContent-Length: %d\r\n\r\n%s", size, strings.Repeat("s", size))
	const get = "GET /hello HTTP/1.1\r\nHost: app.example.net\r\n\r\n"
	e := startPlayedEdge(t, b.Addr(), "spare-stream")
	st, err := e.ys.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	st.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(st)
	for i, req := range []string{get, upload, get} {
		if _, err := io.WriteString(st, req); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("exchange %d: %v", i, err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || resp.Close {
			t.Fatalf("exchange %d: %d, close %v, %v", i, resp.StatusCode, resp.Close, err)
		}
		if want := map[bool]string{true: strconv.Itoa(size), false: "hello"}[req == upload]; string(body) != want {
			t.Fatalf("exchange %d: %q, want %q", i, body, want)
		}
	}
	// A bounded look: a slow agent only makes it weaker, never fail.
	if st := e.accept(t, 300*time.Millisecond); st != nil {
		t.Fatalf("the agent opened stream %d towards the edge", st.StreamID())
	}
}

// TestUnusedStreamHoldsNoDrain: a stream the edge opened and never sent a
// byte on (one its connection pool dialed and did not need) holds up the
// drain of a session whose tunnel was taken over for a second at most,
// not until the stream's wait for a request head (DialTimeout, 10 s here)
// runs out, nor until DrainTimeout.
func TestUnusedStreamHoldsNoDrain(t *testing.T) {
	cfg := agent.DefaultConfig()
	cfg.Local, cfg.Subdomain, cfg.DrainTimeout = "127.0.0.1:1", "app", time.Minute
	a, e := playEdge(t, cfg)
	e.ctrl.SetDeadline(time.Now().Add(20 * time.Second))
	for _, want := range []mux.Type{mux.TypeHello, mux.TypeBind} {
		if m, err := mux.Read(e.ctrl); err != nil || m.MessageType() != want {
			t.Fatalf("read %v (%v), want %s", m, err, want)
		}
	}
	mux.Write(e.ctrl, &mux.HelloOK{SessionID: 1})
	mux.Write(e.ctrl, &mux.BindOK{Hostname: "app.example.net", URL: "https://app.example.net", Generation: 1})
	a.WaitOnline(t)
	st, err := e.ys.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	// Accepted or not yet when the eviction is read, it holds nothing.
	mux.Write(e.ctrl, &mux.Evicted{Hostname: "app.example.net", Reason: mux.ReasonTakeover})
	select {
	case <-e.ys.CloseChan():
	case <-time.After(5 * time.Second):
		t.Fatal("the session of a taken-over tunnel is still open 5 s on: an unused stream holds up its drain")
	}
}

// TestRequestAheadOfEvictionAnswered: a request the edge sends on a new
// stream right before its notice that the tunnel was taken over is
// answered, accepted by the agent's server before or after the notice is
// read: the drain waits for every stream the edge opened to be accepted.
func TestRequestAheadOfEvictionAnswered(t *testing.T) {
	b := tunneltest.StartBackend(t)
	const rounds = 40
	failed := 0
	for i := range rounds {
		e := startPlayedEdge(t, b.Addr())
		st, err := e.ys.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetDeadline(time.Now().Add(20 * time.Second))
		io.WriteString(st, "GET /hello HTTP/1.1\r\nHost: app.example.net\r\n\r\n")
		mux.Write(e.ctrl, &mux.Evicted{Hostname: "app.example.net", Reason: mux.ReasonTakeover})
		resp, err := http.ReadResponse(bufio.NewReader(st), nil)
		if err == nil {
			var body []byte
			body, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			if err == nil && (resp.StatusCode != http.StatusOK || string(body) != "hello") {
				err = fmt.Errorf("%d %q", resp.StatusCode, body)
			}
		}
		if err != nil {
			failed++
			t.Logf("round %d: %v", i, err)
		}
		st.Close()
		e.ys.Close()
	}
	if failed > 0 {
		t.Fatalf("%d of %d requests sent right before the eviction went unanswered", failed, rounds)
	}
}
