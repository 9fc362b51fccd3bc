package edge_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// countingConn counts the bytes read from it.
type countingConn struct {
	net.Conn
	read atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

// TestLargeUploadWaitsForAcceptance: an upload larger than a stream's first
// window waits for the agent to accept the stream before any of it
// leaves, so that it goes out as one flight with the whole window
// (BENCHMARKS.md, run 10); a small one leaves at once. A raw agent that
// holds the stream unaccepted sees what the edge sends meanwhile.
func TestLargeUploadWaitsForAcceptance(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	var link *countingConn
	raw, m := e.DialRawOver(t, hello(""), func(c net.Conn) net.Conn {
		link = &countingConn{Conn: c}
		return link
	})
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	if m, ok := raw.Bind(t, &mux.Bind{Subdomain: "upload"}).(*mux.BindOK); !ok {
		t.Fatalf("bind: %v", m)
	}
	c := e.Client()
	c.Transport.(*http.Transport).TLSClientConfig.NextProtos = []string{"http/1.1"}
	for _, size := range []int{mux.InitialWindow / 2, 4 * mux.InitialWindow} {
		body := bytes.Repeat([]byte("u"), size)
		before := link.read.Load()
		done := make(chan error, 1)
		go func() {
			resp, err := c.Post(tunneltest.URL("https", "upload", "/"), "application/octet-stream", bytes.NewReader(body))
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = io.ErrUnexpectedEOF
				}
			}
			done <- err
		}()
		if size < mux.InitialWindow {
			// Nothing to wait for: the body is on its way unaccepted.
			tunneltest.Eventually(t, 10*time.Second, "the small upload sent before acceptance", func() bool {
				return link.read.Load()-before >= int64(size)
			})
		} else {
			// A bounded look, not a sleep on which a result depends: a slow
			// edge only makes this check weaker, never fail.
			deadline := time.Now().Add(300 * time.Millisecond)
			for time.Now().Before(deadline) {
				if sent := link.read.Load() - before; sent > 64<<10 {
					t.Fatalf("%d bytes of a %d-byte upload left before the agent accepted its stream", sent, size)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		st, err := raw.YS.AcceptStream()
		if err != nil {
			t.Fatal(err)
		}
		st.SetDeadline(time.Now().Add(10 * time.Second))
		req, err := http.ReadRequest(bufio.NewReader(st))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(req.Body)
		if err != nil || !bytes.Equal(got, body) {
			t.Fatalf("the agent read %d of %d bytes: %v", len(got), size, err)
		}
		io.WriteString(st, "HTTP/1.1 200 OK\r\nContent-Length: "+strconv.Itoa(0)+"\r\n\r\n")
		if err := <-done; err != nil {
			t.Fatalf("upload of %d bytes: %v", size, err)
		}
		st.Close()
	}
}

// TestUploadToAgentThatNeverAccepts: an agent that leaves a large upload's
// stream unaccepted would never take its body; the visitor gets the
// tunnel timeout's answer when it runs out, not when the session dies
// (the heartbeat timeout, longer than the client waits here).
func TestUploadToAgentThatNeverAccepts(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TunnelTimeout = 300 * time.Millisecond
	cfg.HeartbeatTimeout = time.Minute
	e := tunneltest.StartEdge(t, cfg)
	boundRaw(t, e, "stuck")
	c := e.Client()
	c.Timeout = 10 * time.Second
	c.Transport.(*http.Transport).TLSClientConfig.NextProtos = []string{"http/1.1"}
	start := time.Now()
	resp, err := c.Post(tunneltest.URL("https", "stuck", "/"), "application/octet-stream", bytes.NewReader(make([]byte, mux.InitialWindow+1)))
	if err != nil {
		t.Fatalf("upload to an agent that never accepts, after %s: %v", time.Since(start), err)
	}
	resp.Body.Close()
	if code := resp.Header.Get(mux.ErrorHeader); resp.StatusCode != http.StatusGatewayTimeout || code != mux.CodeTunnelTimeout {
		t.Fatalf("upload to an agent that never accepts: %d %q, want 504 %s", resp.StatusCode, code, mux.CodeTunnelTimeout)
	}
}

// TestUploadToAgentThatNeverReads: an agent that accepts an upload's
// stream and then takes none of its body (its local service reads none of
// it and does not answer, or the agent never reads its window) would hold
// the visitor for as long as the visitor waits, since the tunnel timeout
// counts from the end of the body. The edge gives each write of the body
// the tunnel timeout afresh: the visitor gets its answer, 504
// tunnel_timeout, once nothing of the body went for that long, over
// HTTP/1.1 and HTTP/2, of a known length and of none (chunked). Each case
// costs about the tunnel timeout.
func TestUploadToAgentThatNeverReads(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TunnelTimeout = 300 * time.Millisecond
	cfg.HeartbeatTimeout = time.Minute // the raw agent sends none
	e := tunneltest.StartEdge(t, cfg)
	raw := boundRaw(t, e, "deaf")
	go func() {
		for {
			// Accepted, and never read: the window closes. The
			// session's end closes the streams.
			if _, err := raw.YS.AcceptStream(); err != nil {
				return
			}
		}
	}()
	for _, h2 := range []bool{false, true} {
		for _, chunked := range []bool{false, true} {
			c := e.Client()
			c.Timeout = 10 * time.Second
			if !h2 {
				http1Only(c)
			}
			var body io.Reader = bytes.NewReader(make([]byte, 4<<20))
			if chunked {
				body = io.MultiReader(body) // no length the client can see
			}
			start := time.Now()
			resp, err := c.Post(tunneltest.URL("https", "deaf", "/"), "application/octet-stream", body)
			if err != nil {
				t.Fatalf("h2 %v, chunked %v: an upload the agent never reads, after %s: %v", h2, chunked, time.Since(start), err)
			}
			resp.Body.Close()
			if code := resp.Header.Get(mux.ErrorHeader); resp.StatusCode != http.StatusGatewayTimeout || code != mux.CodeTunnelTimeout || (resp.ProtoMajor == 2) != h2 {
				t.Fatalf("h2 %v, chunked %v: an upload the agent never reads: %s %d %q, want 504 %s", h2, chunked, resp.Proto, resp.StatusCode, code, mux.CodeTunnelTimeout)
			}
			c.CloseIdleConnections()
		}
	}
}

// TestUpgradeToAgentThatNeverReads: an agent that switches protocols and
// then reads nothing of the upgraded connection held it, and the
// visitor's connection with it (counted against --max-conns), after the
// visitor had gone: the edge's copy towards the agent waited on the
// closed window for as long as the session lived. Each write towards the
// agent gets the tunnel timeout afresh, as a request body's does; past it
// the upgraded connection ends on both sides. About a second.
func TestUpgradeToAgentThatNeverReads(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TunnelTimeout = 300 * time.Millisecond
	cfg.HeartbeatTimeout = time.Minute // the raw agent sends none
	e := tunneltest.StartEdge(t, cfg)
	hold := make(chan struct{})
	t.Cleanup(func() { close(hold) })
	answerStreams(boundRaw(t, e, "ws"), func(st net.Conn, _ *http.Request) {
		io.WriteString(st, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		<-hold // and read nothing more
	})
	c, err := net.Dial("tcp", e.Addr("http").String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: ws.%s\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", tunneltest.Domain)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	// The visitor sends until nothing more goes, then leaves.
	c.SetWriteDeadline(time.Now().Add(2 * time.Second))
	io.Copy(c, tunneltest.Pattern(256<<20))
	c.Close()
	tunneltest.Eventually(t, 10*time.Second, "the upgraded connection to end at the edge", func() bool {
		return scrape(t, e, "")["ngstone_streams_active"] == 0
	})
}

// TestLargeUploadOnAgentsSpare: an agent that keeps a spare stream open
// (the edge lists mux.FeatureSpareStream) gets a large upload on it, sent
// at once: the edge does not wait for an acceptance the agent's own
// stream does not need. The spare serves that one request. An agent that
// opens streams beyond its spare has them closed, and its session too at
// the third.
func TestLargeUploadOnAgentsSpare(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = time.Minute // the raw agent sends none
	e := tunneltest.StartEdge(t, cfg)
	raw, m := e.DialRaw(t, hello(""))
	if ok, _ := m.(*mux.HelloOK); ok == nil || !slices.Contains(ok.Features, mux.FeatureSpareStream) {
		t.Fatalf("hello: %v, want hello_ok listing %s", m, mux.FeatureSpareStream)
	}
	if m, ok := raw.Bind(t, &mux.Bind{Subdomain: "spare"}).(*mux.BindOK); !ok {
		t.Fatalf("bind: %v", m)
	}
	c := e.Client()
	c.Transport.(*http.Transport).TLSClientConfig.NextProtos = []string{"http/1.1"}
	body := bytes.Repeat([]byte("s"), 4*mux.InitialWindow)
	spare, err := raw.YS.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	onSpare := make(chan error, 1)
	go func() { onSpare <- answerUpload(spare, body) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opened := make(chan net.Conn)
	go func() {
		for {
			st, err := raw.YS.AcceptStreamWithContext(ctx)
			if err != nil {
				return
			}
			select {
			case opened <- st:
			case <-ctx.Done():
				st.Close()
				return
			}
		}
	}()
	// The edge keeps the spare once its goroutine has accepted it; an
	// upload before that gets a stream of its own, which is answered too,
	// and the next one is tried (bounded).
	deadline := time.Now().Add(10 * time.Second)
	for used := false; !used; {
		if time.Now().After(deadline) {
			t.Fatal("no upload came on the agent's spare stream")
		}
		done := make(chan error, 1)
		go func() {
			resp, err := c.Post(tunneltest.URL("https", "spare", "/"), "application/octet-stream", bytes.NewReader(body))
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = fmt.Errorf("status %d", resp.StatusCode)
				}
			}
			done <- err
		}()
		select {
		case err := <-onSpare:
			if err != nil {
				t.Fatalf("the upload on the spare: %v", err)
			}
			used = true
		case st := <-opened:
			if err := answerUpload(st, body); err != nil {
				t.Fatalf("the upload on a new stream: %v", err)
			}
		}
		if err := <-done; err != nil {
			t.Fatalf("upload: %v", err)
		}
	}
	// The place is free again: one spare is kept, the next three are
	// refused, and the third refusal ends the session.
	for range 4 {
		if _, err := raw.YS.OpenStream(); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-raw.YS.CloseChan():
	case <-time.After(10 * time.Second):
		t.Fatal("the session of an agent opening streams beyond its spare is still up")
	}
}

// answerUpload reads one request from st, checks that its body is want,
// and answers 200.
func answerUpload(st net.Conn, want []byte) error {
	defer st.Close()
	st.SetDeadline(time.Now().Add(10 * time.Second))
	req, err := http.ReadRequest(bufio.NewReader(st))
	if err != nil {
		return err
	}
	got, err := io.ReadAll(req.Body)
	if err != nil || !bytes.Equal(got, want) {
		return fmt.Errorf("read %d of %d bytes: %v", len(got), len(want), err)
	}
	_, err = io.WriteString(st, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
	return err
}
