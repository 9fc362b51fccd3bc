package agent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// pipeAgent is an agent whose local service and edge are both in memory:
// each exchange dials a pipe to a goroutine that writes the local
// service's bytes, and the edge's side of the stream is another pipe.
type pipeAgent struct {
	a     *Agent
	conns chan net.Conn // streams for the agent's server
	done  chan struct{}
	held  mux.Tracker

	mu    sync.Mutex
	reply []byte // what the local service writes, then closes
}

func newPipeAgent(t testing.TB) *pipeAgent {
	a, err := New(Config{Edge: "localhost:1", Tunnel: Tunnel{Local: "127.0.0.1:1", UpstreamTimeout: 5 * time.Second}}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	p := &pipeAgent{a: a, conns: make(chan net.Conn), done: make(chan struct{})}
	tr := a.tunnels[0].transport()
	tr.DisableKeepAlives = true
	tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		c, local := net.Pipe()
		p.mu.Lock()
		reply := p.reply
		p.mu.Unlock()
		go func() {
			defer local.Close()
			http.ReadRequest(bufio.NewReader(local))
			local.SetWriteDeadline(time.Now().Add(5 * time.Second))
			local.Write(reply)
		}()
		return c, nil
	}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		a.serveStreams(p, &p.held, new(atomic.Int64))
	}()
	t.Cleanup(func() {
		close(p.done)
		a.wg.Wait()
	})
	return p
}

func (p *pipeAgent) Accept() (net.Conn, error) {
	select {
	case c := <-p.conns:
		return c, nil
	case <-p.done:
		return nil, net.ErrClosed
	}
}
func (p *pipeAgent) Close() error   { return nil }
func (p *pipeAgent) Addr() net.Addr { return &net.TCPAddr{} }

// relay has the agent answer one GET with the local service's reply, and
// returns what the edge's net/http reads of it on the stream.
func (p *pipeAgent) relay(reply []byte) (seen, error) {
	p.mu.Lock()
	p.reply = reply
	p.mu.Unlock()
	edge, st := net.Pipe()
	defer edge.Close()
	p.conns <- st
	edge.SetDeadline(time.Now().Add(10 * time.Second))
	go io.WriteString(edge, "GET / HTTP/1.1\r\nHost: app.ngstone.test\r\nX-Forwarded-Host: app.ngstone.test\r\n\r\n")
	return readSeen(bufio.NewReader(edge), mux.Max1xx+2)
}

// seen is one response as net/http reads it: status, the Ngstone-Error
// code, the body, whether its body ended cleanly, and the informational
// responses before it.
type seen struct {
	status int
	code   string
	body   string
	whole  bool
	n1xx   int
}

// readSeen reads a response, skipping at most max informational ones.
func readSeen(br *bufio.Reader, max int) (seen, error) {
	var s seen
	for ; s.n1xx <= max; s.n1xx++ {
		resp, err := http.ReadResponse(br, &http.Request{Method: "GET"})
		if err != nil {
			return s, err
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != 101 {
			continue // informational, as net/http's transport reads them
		}
		body, err := io.ReadAll(resp.Body)
		s.status, s.code, s.body, s.whole = resp.StatusCode, resp.Header.Get(mux.ErrorHeader), string(body), err == nil
		return s, nil
	}
	return s, errors.New("too many informational responses")
}

// FuzzResponseCrossing: whatever a local service answers, what the agent
// sends on is what the edge's net/http reads, and it says the same as the
// local service's answer read by net/http: a response read whole crosses
// with its status and body; one that cannot be read becomes the agent's
// coded 502; one cut short never crosses as a whole one. An input one side
// accepts and the other refuses is a failure.
func FuzzResponseCrossing(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
		"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n5\r\nhello\r\n0\r\nX-Sum: 1\r\n\r\n",
		"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
		"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		strings.Repeat("HTTP/1.1 100 Continue\r\n\r\n", 17) + "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
		"SSH-2.0-OpenSSH\r\n",
		"",
	} {
		f.Add([]byte(s))
	}
	p := newPipeAgent(f)
	f.Fuzz(func(t *testing.T, reply []byte) {
		local, lerr := readSeen(bufio.NewReader(bytes.NewReader(reply)), 1<<20)
		localOK := lerr == nil
		got, err := p.relay(reply)
		if err != nil {
			// The agent broke the stream off before a response: only for
			// a local answer cut short, which the edge then answers with
			// 502 bad_response.
			if !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) || localOK && local.whole && local.status >= 200 && local.status <= 599 {
				t.Fatalf("the edge could not read what the agent sent for %q (%+v, %v): %v", reply, local, lerr, err)
			}
			return
		}
		switch {
		case got.code != "":
			// The agent answered itself: only for what net/http could not
			// read, or read but not whole, or past its bounds.
			if localOK && local.whole && local.status >= 200 && local.status <= 599 && local.n1xx < mux.Max1xx {
				t.Fatalf("local answer %q read whole as %d, but the agent answered %d %s", reply, local.status, got.status, got.code)
			}
			if got.status != http.StatusBadGateway {
				t.Fatalf("the agent's own answer for %q: %d %s", reply, got.status, got.code)
			}
		case !localOK:
			t.Fatalf("local answer %q is not a response to net/http, but the agent sent %d on", reply, got.status)
		case got.whole && (!local.whole || got.status != local.status || got.body != local.body):
			t.Fatalf("local answer %q reads as %+v, but crossed whole as %+v", reply, local, got)
		}
	})
}
