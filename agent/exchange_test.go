package agent

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// fakeWatched is a watched connection whose reads the test sets.
type fakeWatched struct {
	read     int64
	waiting  bool // bytes wait on the socket
	poisoned bool
}

func (f *fakeWatched) idle() (int64, bool) { return f.read, !f.waiting && !f.poisoned }
func (f *fakeWatched) poison()             { f.poisoned = true }
func (f *fakeWatched) readSoFar() int64    { return f.read }
func (f *fakeWatched) isPoisoned() bool    { return f.poisoned }
func (f *fakeWatched) spokeHTTP2() bool    { return false }

var _ watched = (*fakeWatched)(nil) // else watchedOf finds no watched connection, and the checks are skipped

// watchedNet is a net.Conn that is a fakeWatched (GotConnInfo carries a
// net.Conn).
type watchedNet struct {
	net.Conn
	*fakeWatched
}

// TestExchangeTraceChecksLocalConnection: the trace each stream's exchange
// carries makes the two clean checks (the load test of them,
// TestStrayBytesNeverCrossVisitors, needs a busy machine to fail), and
// the stream context's trace stays the one that ends a request on too
// many informational responses.
func TestExchangeTraceChecksLocalConnection(t *testing.T) {
	a := relayAgent(t, "http://127.0.0.1:1")
	x := &exchange{t: a.tunnels[0]} // routed, as serveExchange does before the request
	trace := httptrace.ContextClientTrace(a.withExchange(context.Background(), x))
	if trace == nil || trace.GotConn == nil || trace.GotFirstResponseByte == nil || trace.Got1xxResponse == nil {
		t.Fatalf("exchange trace %+v, want the clean checks and the 1xx count", trace)
	}
	t.Run("bytes waiting on a reused connection", func(t *testing.T) {
		c := &fakeWatched{read: 10, waiting: true}
		x.check.reset()
		trace.GotConn(httptrace.GotConnInfo{Conn: watchedNet{fakeWatched: c}, Reused: true})
		if !c.poisoned {
			t.Fatal("a reused connection with bytes waiting was not poisoned")
		}
	})
	t.Run("a response before its request", func(t *testing.T) {
		c := &fakeWatched{read: 10}
		x.check.reset()
		trace.GotConn(httptrace.GotConnInfo{Conn: watchedNet{fakeWatched: c}, Reused: true})
		trace.GotFirstResponseByte() // nothing read from the socket since
		if !x.check.refused() || !c.poisoned {
			t.Fatalf("refused %v poisoned %v, want the response refused and the connection poisoned", x.check.refused(), c.poisoned)
		}
	})
	t.Run("a response read after its request", func(t *testing.T) {
		c := &fakeWatched{read: 10}
		x.check.reset()
		trace.GotConn(httptrace.GotConnInfo{Conn: watchedNet{fakeWatched: c}, Reused: true})
		c.read += 40
		trace.GotFirstResponseByte()
		if x.check.refused() || c.poisoned {
			t.Fatal("a clean exchange was refused")
		}
	})
	t.Run("HTTP/2 makes no checks", func(t *testing.T) {
		cfg := Config{}
		cfg.UpstreamProtocol = ProtocolHTTP2
		h2 := relayAgentWith(t, "http://127.0.0.1:1", cfg, nil)
		x := &exchange{t: h2.tunnels[0]}
		tr := httptrace.ContextClientTrace(h2.withExchange(context.Background(), x))
		c := &fakeWatched{read: 10, waiting: true}
		tr.GotConn(httptrace.GotConnInfo{Conn: watchedNet{fakeWatched: c}, Reused: true})
		tr.GotFirstResponseByte()
		if c.poisoned || x.check.refused() || tr.Got1xxResponse == nil {
			t.Fatal("an HTTP/2 tunnel's exchange made the clean checks, or lacks the 1xx count")
		}
	})
}

// TestTooManyInformational: a local service that sends informational
// responses without end gets its visitor the agent's 502 once it is past
// mux.Max1xx, however the reverse proxy composes its own trace with the
// stream's.
func TestTooManyInformational(t *testing.T) {
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		for range mux.Max1xx + 4 {
			w.WriteHeader(http.StatusEarlyHints)
		}
		io.WriteString(w, "final")
	})
	a := relayAgent(t, s.URL)
	req, _ := http.NewRequest("GET", "http://app.ngstone.test/", nil)
	resp, body, err := relayOnce(t, a, req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusBadGateway || resp.Header.Get(mux.ErrorHeader) != mux.CodeBadResponse || strings.Contains(body, "final") {
		t.Fatalf("got %d %s=%q %q, want 502 %s", resp.StatusCode, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader), body, mux.CodeBadResponse)
	}
}

// TestDeadlinePassed reads grpc-timeout as gRPC's wire format has it, and
// takes nothing else for a deadline.
func TestDeadlinePassed(t *testing.T) {
	start := time.Now().Add(-time.Second) // a second ago
	for v, want := range map[string]bool{
		"500m": true, "1S": true, "999999u": true, "1000000000n": false, // ten digits
		"2S": false, "1M": false, "1H": false, "99999999H": false,
		"": false, "m": false, "5": false, "5x": false, "+5m": false, "-5m": false, " 5m": false,
	} {
		h := http.Header{"Grpc-Timeout": {v}}
		if got := deadlinePassed(h, start); got != want {
			t.Errorf("grpc-timeout %q a second after the start: passed %v, want %v", v, got, want)
		}
	}
}
