package agent_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// strayServer is a local service that answers each request with the
// secret the request carried, then writes bytes nobody asked for on the
// same connection: a whole response carrying that secret again, which a
// relay reusing the connection would hand the next visitor as its own.
// mode says where the stray bytes go: after a response to HEAD (as its
// "body"), after a 204 or a 304, or past the Content-Length of a 200; later
// sends them a few milliseconds after the response instead of with it.
// closed receives when a connection's other end (the agent) closed it.
func strayServer(t *testing.T, mode string, later time.Duration) (addr string, closed <-chan struct{}) {
	t.Helper()
	gone := make(chan struct{}, 1000)
	return tunneltest.ServeConns(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				gone <- struct{}{}
				return
			}
			io.Copy(io.Discard, req.Body)
			secret := req.Header.Get("X-Secret")
			stray := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(secret), secret)
			var resp string
			switch mode {
			case "HEAD":
				resp = fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", len(stray))
			case "204":
				resp = "HTTP/1.1 204 No Content\r\n\r\n"
			case "304":
				resp = "HTTP/1.1 304 Not Modified\r\n\r\n"
			default:
				resp = fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(secret), secret)
			}
			if later == 0 {
				io.WriteString(c, resp+stray)
				continue
			}
			io.WriteString(c, resp)
			time.Sleep(later)
			io.WriteString(c, stray)
		}
	}), gone
}

// TestStrayBytesNeverCrossVisitors: whatever a local service writes after
// a finished response (a body for HEAD, bytes after a 204 or 304, more
// than its Content-Length, at once or a moment later), two visitors taking
// turns, each with a secret of its own, never receive each other's bytes:
// a connection that received bytes nobody asked for is not reused.
func TestStrayBytesNeverCrossVisitors(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	for _, tc := range []struct {
		mode  string
		later time.Duration
	}{{"HEAD", 0}, {"204", 0}, {"304", 0}, {"200", 0}, {"HEAD", 5 * time.Millisecond}, {"200", 5 * time.Millisecond}} {
		name := fmt.Sprintf("%s-%s", tc.mode, tc.later)
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			sub := strings.ToLower(strings.NewReplacer(".", "", "µ", "u").Replace("stray-" + name))
			addr, closed := strayServer(t, tc.mode, tc.later)
			cfg := e.AgentConfig("", addr)
			cfg.Subdomain = sub
			tunneltest.StartAgent(t, cfg).WaitOnline(t)
			method := "GET"
			if tc.mode == "HEAD" {
				method = "HEAD"
			}
			visitors := []*http.Client{e.Client(), e.Client()}
			crossed, refused := 0, 0
			for round := range 200 {
				if tc.later > 0 && round > 0 {
					// The stray bytes arrive while the connection is
					// idle, before the next request (a request sent
					// before they come could not tell them from its
					// answer, through any HTTP/1.1 relay): the agent
					// closes that connection.
					select {
					case <-closed:
					case <-time.After(10 * time.Second):
						t.Fatalf("round %d: the agent kept a connection that received bytes nobody asked for", round)
					}
				}
				who := round % 2
				secret := fmt.Sprintf("visitor-%d-secret-%d", who, round)
				req, _ := http.NewRequest(method, tunneltest.URL("http", sub, "/"), nil)
				req.Header.Set("X-Secret", secret)
				resp, err := visitors[who].Do(req)
				if err != nil {
					t.Fatalf("round %d: %v", round, err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				got := string(body) + fmt.Sprint(resp.Header)
				if other := fmt.Sprintf("visitor-%d-", 1-who); strings.Contains(got, other) {
					crossed++
					t.Errorf("round %d: visitor %d received the other visitor's bytes: %d %q", round, who, resp.StatusCode, got)
				}
				switch code := resp.Header.Get(mux.ErrorHeader); {
				case resp.StatusCode == http.StatusBadGateway && code == mux.CodeBadResponse:
					// The transport gave the connection out before its
					// own read had found the stray bytes it buffered
					// (a busy machine): the answer there before the
					// request is refused, as README says.
					refused++
				case resp.StatusCode >= 500:
					t.Errorf("round %d: %d %s", round, resp.StatusCode, code)
				}
			}
			if refused > 10 {
				t.Errorf("%d of 200 rounds refused: the connections with stray bytes are not closed", refused)
			}
			t.Logf("200 rounds, %d crossed, %d refused", crossed, refused)
		})
	}
}

// TestSlowUploads: uploads that take longer than the local service's and
// the tunnel's response timeouts, slowly but steadily, reach the local
// service whole and get their answer with the default timeouts: those
// timeouts run from the end of the request body.
func TestSlowUploads(t *testing.T) {
	if testing.Short() {
		t.Skip("45 s of slow uploads")
	}
	local, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		fmt.Fprintf(w, "%d", n)
	})}
	go srv.Serve(local)
	t.Cleanup(func() { srv.Close() })
	ecfg := tunneltest.EdgeConfig(t)
	d := edge.DefaultConfig()
	ecfg.TunnelTimeout, ecfg.ReadTimeout, ecfg.WriteTimeout = d.TunnelTimeout, d.ReadTimeout, d.WriteTimeout
	e := tunneltest.StartEdge(t, ecfg)
	cfg := e.AgentConfig("", local.Addr().String())
	cfg.Subdomain = "slow"
	def := agent.DefaultConfig()
	cfg.UpstreamTimeout, cfg.DialTimeout, cfg.UpstreamDialTimeout = def.UpstreamTimeout, def.DialTimeout, def.UpstreamDialTimeout
	tunneltest.StartAgent(t, cfg).WaitOnline(t)

	for _, tc := range []struct {
		name        string
		size, chunk int
		every       time.Duration
		length, h2  bool
	}{
		{name: "1 KiB/s for 45 s, chunked, HTTP/2", size: 45 << 10, chunk: 1 << 10, every: time.Second, h2: true},
		// 20 KiB at this pace would take 17 minutes; 900 bytes take as
		// long as the other upload, past the agent's 30 s response
		// timeout, and stay under 32 KiB, where the defect cut them at
		// the agent's dial timeout.
		{name: "900 bytes at 1 byte per 50 ms, with a length, HTTP/1.1", size: 900, chunk: 1, every: 50 * time.Millisecond, length: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pr, pw := io.Pipe()
			go func() {
				tick := time.NewTicker(tc.every)
				defer tick.Stop()
				buf := make([]byte, tc.chunk)
				for sent := 0; sent < tc.size; sent += tc.chunk {
					<-tick.C
					if _, err := pw.Write(buf); err != nil {
						return
					}
				}
				pw.Close()
			}()
			scheme, c := "https", e.Client()
			if !tc.h2 {
				scheme = "http"
			}
			req, _ := http.NewRequestWithContext(context.Background(), "POST", tunneltest.URL(scheme, "slow", "/upload"), pr)
			if tc.length {
				req.ContentLength = int64(tc.size)
			}
			c.Timeout = 2 * time.Minute
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || string(body) != fmt.Sprint(tc.size) {
				t.Fatalf("%d %s %q, want 200 and the %d bytes counted", resp.StatusCode, resp.Header.Get(mux.ErrorHeader), body, tc.size)
			}
		})
	}
}

// TestLocalServiceThatNeverReadsTheBody: a local service that reads a
// request's head, then neither reads its body nor answers, would hold the
// agent's exchange (its goroutines, the stream, the connection) and the
// visitor for as long as it liked: the upstream timeout counts from the
// end of the body, which never comes. The agent gives each write to the
// local service the upstream timeout afresh, so the visitor gets 504
// upstream_timeout once nothing of the body went for that long (the edge's
// own timeout for that is longer here), and the agent closes the
// connection. About a second: a 32 MiB upload fills the buffers on the way.
func TestLocalServiceThatNeverReadsTheBody(t *testing.T) {
	answered := make(chan struct{})
	closed := make(chan error, 1)
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		select { // read nothing more until the visitor has its answer
		case <-answered:
		case <-time.After(20 * time.Second):
		}
		// Then drain: the agent's close ends it, a held exchange does not.
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := io.Copy(io.Discard, c)
		closed <- err
	})
	ecfg := tunneltest.EdgeConfig(t)
	ecfg.TunnelTimeout = time.Minute
	e := tunneltest.StartEdge(t, ecfg)
	cfg := e.AgentConfig("", local)
	cfg.Subdomain = "deaf"
	cfg.UpstreamTimeout = 300 * time.Millisecond
	tunneltest.StartAgent(t, cfg).WaitOnline(t)
	// By hand: net/http's client reports its failed write, not the
	// answer that came before it.
	vc, err := net.Dial("tcp", e.Addr("http").String())
	if err != nil {
		t.Fatal(err)
	}
	defer vc.Close()
	go func() {
		fmt.Fprintf(vc, "POST /upload HTTP/1.1\r\nHost: deaf.%s\r\nContent-Length: %d\r\n\r\n", tunneltest.Domain, 32<<20)
		io.Copy(vc, tunneltest.Pattern(32<<20))
	}()
	vc.SetReadDeadline(time.Now().Add(15 * time.Second))
	start := time.Now()
	resp, err := http.ReadResponse(bufio.NewReader(vc), nil)
	close(answered)
	if err != nil {
		t.Fatalf("an upload the local service never reads, after %s: %v", time.Since(start), err)
	}
	if code := resp.Header.Get(mux.ErrorHeader); resp.StatusCode != http.StatusGatewayTimeout || code != mux.CodeUpstreamTimeout {
		t.Fatalf("an upload the local service never reads: %d %q, want 504 %s", resp.StatusCode, code, mux.CodeUpstreamTimeout)
	}
	var ne net.Error
	if err := <-closed; errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the agent still holds the connection to the local service after the visitor's answer: %v", err)
	}
}

// rawLocal answers every request with the reply its path names, then
// closes the connection.
func rawLocal(t *testing.T, replies map[string]string) string {
	t.Helper()
	return tunneltest.ServeConns(t, func(c net.Conn) {
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		io.WriteString(c, replies[req.URL.Path])
	})
}

// TestFramingVisitorMatchesLog: for each framing a local service may send,
// the status and code the visitor gets through a real edge are the ones
// the agent logs for the exchange.
func TestFramingVisitorMatchesLog(t *testing.T) {
	replies := map[string]string{
		"/signed-length": "HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello",
		"/gzip-chunked":  "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
		"/nul-in-value":  "HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 0\r\n\r\n",
		"/max-1xx":       strings.Repeat("HTTP/1.1 103 Early Hints\r\n\r\n", mux.Max1xx) + "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"/many-1xx":      strings.Repeat("HTTP/1.1 103 Early Hints\r\n\r\n", mux.Max1xx+1) + "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"/many-100":      strings.Repeat("HTTP/1.1 100 Continue\r\n\r\n", mux.Max1xx+1) + "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"/15-100":        strings.Repeat("HTTP/1.1 100 Continue\r\n\r\n", 15) + "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"/status-000":    "HTTP/1.1 000 Zero\r\nContent-Length: 0\r\n\r\n",
		"/two-lengths":   "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
		"/cut-short":     "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
		"/folded":        "HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 2\r\n\r\nok",
		"/fine":          "HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
		"/until-close":   "HTTP/1.0 200 OK\r\n\r\nall of it",
	}
	var logs lockedBuffer
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", rawLocal(t, replies))
	cfg.Subdomain, cfg.LogRequests = "framing", true
	tunneltest.StartAgentLogged(t, cfg, slog.New(slog.NewJSONHandler(&logs, nil))).WaitOnline(t)
	c := e.Client()
	// The informational bound, as README states it: Max1xx pass, one
	// more is the agent's 502. (The 100 Continues count towards it, but
	// the edge's server passes none to a visitor that did not ask: -1,
	// not counted.)
	bound := map[string]struct{ status, n1xx int }{
		"/max-1xx": {http.StatusOK, mux.Max1xx}, "/many-1xx": {http.StatusBadGateway, mux.Max1xx},
		"/15-100": {http.StatusOK, -1}, "/many-100": {http.StatusBadGateway, -1},
	}
	for path := range replies {
		var n1xx atomic.Int32
		ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
			Got1xxResponse: func(int, textproto.MIMEHeader) error { n1xx.Add(1); return nil },
		})
		req, _ := http.NewRequestWithContext(ctx, "GET", tunneltest.URL("https", "framing", path), nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if want, ok := bound[path]; ok && (resp.StatusCode != want.status || want.n1xx >= 0 && int(n1xx.Load()) != want.n1xx) {
			t.Errorf("%s: the visitor got %d after %d informational responses, want %d after %d", path, resp.StatusCode, n1xx.Load(), want.status, want.n1xx)
		}
		var line map[string]any
		tunneltest.Eventually(t, 5*time.Second, "the agent's line for "+path, func() bool {
			line = logs.line("request", path)
			return line != nil
		})
		code, _ := line["code"].(string)
		if int(line["status"].(float64)) != resp.StatusCode || code != resp.Header.Get(mux.ErrorHeader) {
			t.Errorf("%s: the visitor got %d %q, the agent logged %v %q", path, resp.StatusCode, resp.Header.Get(mux.ErrorHeader), line["status"], code)
		}
	}
}

// lockedBuffer collects JSON log lines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// line returns the first log line with msg for path.
func (b *lockedBuffer) line(msg, path string) map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
	for l := range strings.Lines(b.buf.String()) {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg && m["path"] == path {
			return m
		}
	}
	return nil
}
