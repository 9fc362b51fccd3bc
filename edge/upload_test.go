package edge_test

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
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
	raw, m := e.DialRaw(t, hello(""))
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	if m, ok := raw.Bind(t, &mux.Bind{Subdomain: "stuck"}).(*mux.BindOK); !ok {
		t.Fatalf("bind: %v", m)
	}
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
