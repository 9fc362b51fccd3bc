package agent_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
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

// exchange writes req on st and returns the response's status and body.
func exchange(t *testing.T, st net.Conn, req string) (int, string) {
	t.Helper()
	st.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(st, req); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(st), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// TestSpareStream: given an edge that lists mux.FeatureSpareStream, the
// agent keeps one stream open towards it in advance; a request written
// on it is served as on a stream the edge opened, after which the agent
// opens the next spare. A spare the edge closes unused is replaced, but
// not after three in a row, and the edge's own streams are still served. An edge without the feature never
// sees a stream from the agent beyond the control stream.
func TestSpareStream(t *testing.T) {
	b := tunneltest.StartBackend(t)
	const size = 1 << 20
	upload := fmt.Sprintf("POST /echo HTTP/1.1\r\nHost: app.example.net\r\nContent-Length: %d\r\n\r\n%s", size, strings.Repeat("s", size))
	const get = "GET /hello HTTP/1.1\r\nHost: app.example.net\r\n\r\n"

	t.Run("offered", func(t *testing.T) {
		e := startPlayedEdge(t, b.Addr(), mux.FeatureSpareStream)
		first := e.accept(t, 10*time.Second)
		if first == nil {
			t.Fatal("the agent opened no spare stream for an edge that takes one")
		}
		if code, body := exchange(t, first, upload); code != http.StatusOK || len(body) != size {
			t.Fatalf("upload on the spare: %d, %d of %d bytes echoed", code, len(body), size)
		}
		first.Close()
		next := e.accept(t, 10*time.Second)
		if next == nil {
			t.Fatal("no new spare after the first was used")
		}
		if next.StreamID() == first.StreamID() {
			t.Fatalf("the next spare has the first one's id %d", next.StreamID())
		}
		// Spares closed unused are replaced, up to three in a row.
		for i := 1; ; i++ {
			last := next.StreamID()
			next.Close()
			if i == 3 {
				break
			}
			if next = e.accept(t, 10*time.Second); next == nil || next.StreamID() <= last {
				t.Fatalf("no new spare after %d closed unused (%v)", i, next)
			}
		}
		if extra := e.accept(t, 300*time.Millisecond); extra != nil {
			t.Fatalf("a spare (stream %d) after the edge closed three unused", extra.StreamID())
		}
		st, err := e.ys.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if code, body := exchange(t, st, get); code != http.StatusOK || body != "hello" {
			t.Fatalf("the edge's own stream: %d %q", code, body)
		}
	})
	t.Run("not offered", func(t *testing.T) {
		e := startPlayedEdge(t, b.Addr())
		// A bounded look: a slow agent only makes it weaker, never fail.
		if st := e.accept(t, 300*time.Millisecond); st != nil {
			t.Fatalf("the agent opened stream %d towards an edge without %s", st.StreamID(), mux.FeatureSpareStream)
		}
		st, err := e.ys.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if code, body := exchange(t, st, get); code != http.StatusOK || body != "hello" {
			t.Fatalf("the edge's stream: %d %q", code, body)
		}
	})
}
