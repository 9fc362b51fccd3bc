package edge_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

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

// TestAgentStreamsRefused: the edge opens the streams of its exchanges and
// lists no "spare-stream" (an older agent's stream for large uploads); an
// agent that opens streams has them closed, and its session too at the
// third.
func TestAgentStreamsRefused(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = time.Minute // the raw agent sends none
	e := tunneltest.StartEdge(t, cfg)
	raw, m := e.DialRaw(t, hello(""))
	if ok, _ := m.(*mux.HelloOK); ok == nil || slices.Contains(ok.Features, "spare-stream") {
		t.Fatalf("hello: %v, want hello_ok without spare-stream", m)
	}
	for range 3 {
		if _, err := raw.YS.OpenStream(); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-raw.YS.CloseChan():
	case <-time.After(10 * time.Second):
		t.Fatal("the session of an agent opening streams towards the edge is still up")
	}
}

// TestUnreadUploadsInTurn: a local service that answers uploads without
// reading them (an early 401 or 413, a webhook that answers first) leaves
// no connection behind that looks kept open but is not. A visitor sends
// uploads one after another, over HTTP/1.1 and HTTPS. Larger than a
// server reads after its answer, each ends the agent's stream and the
// visitor's connection with a response that says so (Connection: close),
// and the next takes a fresh one; smaller, the rest is read and the
// connection carries the next. No upload gets the edge's 502 for a stream
// that was closed under it. Closing with the visitor still sending, the
// edge's server may reset the connection before the visitor reads the
// answer, as any HTTP/1.1 server that closes may: that upload fails on
// its own, and the next one does not.
func TestUnreadUploadsInTurn(t *testing.T) {
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "answered unread")
	}))
	t.Cleanup(local.Close)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	ac := e.AgentConfig("", strings.TrimPrefix(local.URL, "http://"))
	ac.Subdomain = "unread"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	for _, tc := range []struct {
		scheme string
		size   int
	}{{"http", 512 << 10}, {"https", 512 << 10}, {"http", mux.KeptUnread / 2}, {"https", mux.KeptUnread / 2}} {
		scheme, body := tc.scheme, make([]byte, tc.size)
		c := e.Client()
		c.Timeout = 10 * time.Second
		http1Only(c)
		answered := 0
		for i := range 8 {
			resp, err := c.Post(tunneltest.URL(scheme, "unread", "/"), "application/octet-stream", bytes.NewReader(body))
			if err != nil && len(body) > mux.KeptUnread {
				continue // the connection closed under the visitor's upload
			}
			if err != nil {
				t.Fatalf("%s upload %d of %d bytes: %v", scheme, i, len(body), err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || string(b) != "answered unread" {
				t.Fatalf("%s upload %d of %d bytes: %d %q, want 200 from the local service", scheme, i, len(body), resp.StatusCode, b)
			}
			answered++
		}
		if answered == 0 {
			t.Errorf("%s: none of 8 uploads of %d bytes answered", scheme, len(body))
		}
		c.CloseIdleConnections()
	}
}
