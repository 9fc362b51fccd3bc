package edge_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// keepAliveAgent is a raw agent that serves each stream the edge opens as
// a keep-alive connection, answering every request with its name, and
// records which stream carried which host.
type keepAliveAgent struct {
	name string
	open atomic.Int32 // its streams not yet ended

	mu      sync.Mutex
	hosts   map[uint32][]string // stream id -> the hosts of its requests
	served  int
	stray   string // written after the first answer of the first stream
	strayed chan struct{}
}

func serveKeepAlive(r *tunneltest.RawSession, name string) *keepAliveAgent {
	return startKeepAlive(r, &keepAliveAgent{name: name, hosts: map[uint32][]string{}, strayed: make(chan struct{})})
}

func startKeepAlive(r *tunneltest.RawSession, k *keepAliveAgent) *keepAliveAgent {
	name := k.name
	go func() {
		for first := true; ; first = false {
			st, err := r.YS.AcceptStream()
			if err != nil {
				return
			}
			k.open.Add(1)
			go func(first bool) {
				defer k.open.Add(-1)
				defer st.Close()
				br := bufio.NewReader(st)
				wrote := false
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						if first && k.stray != "" {
							close(k.strayed) // the edge closed the stream
						}
						return
					}
					io.Copy(io.Discard, req.Body)
					k.mu.Lock()
					k.hosts[st.StreamID()] = append(k.hosts[st.StreamID()], req.Host)
					k.served++
					k.mu.Unlock()
					fmt.Fprintf(st, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(name), name)
					if first && k.stray != "" && !wrote {
						io.WriteString(st, k.stray)
						wrote = true
					}
				}
			}(first)
		}
	}()
	return k
}

func (k *keepAliveAgent) counts() (requests, streams int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.served, len(k.hosts)
}

// get fetches sub's / and returns the body.
func get(t *testing.T, c *http.Client, sub string) string {
	t.Helper()
	resp, err := c.Get(tunneltest.URL("http", sub, "/"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", sub, resp.StatusCode, b)
	}
	return string(b)
}

// TestPooledStreamsStayWithTheirSession: the streams a session keeps open
// between exchanges carry only the exchanges routed to it: two agents'
// requests, interleaved and concurrent, each reach their own agent on
// reused streams. After a takeover moves a name to another session, the
// old session (which still holds another name) has its idle streams
// closed at once, and they carry no request.
func TestPooledStreamsStayWithTheirSession(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = time.Minute // raw agents send none
	e := tunneltest.StartEdge(t, cfg)
	ha, hb := hello(""), hello("")
	ra, rb := dialBound(t, e, ha, "pa"), dialBound(t, e, hb, "pb")
	// A holds a second name, so its session outlives the takeover below.
	if m, ok := ra.Bind(t, &mux.Bind{Subdomain: "pa2"}).(*mux.BindOK); !ok {
		t.Fatalf("bind pa2: %v", m)
	}
	a, b := serveKeepAlive(ra, "A"), serveKeepAlive(rb, "B")
	c := e.Client()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 50 {
				sub, want := "pa", "A"
				if (w+i)%2 == 1 {
					sub, want = "pb", "B"
				}
				if got := get(t, c, sub); got != want {
					t.Errorf("%s answered by %q, want %q", sub, got, want)
				}
			}
		})
	}
	wg.Wait()
	for _, k := range []*keepAliveAgent{a, b} {
		k.mu.Lock()
		for id, hosts := range k.hosts {
			for _, h := range hosts {
				if want := "p" + string(rune(k.name[0]+'a'-'A')) + "." + tunneltest.Domain; h != want {
					t.Errorf("agent %s's stream %d carried a request for %s", k.name, id, h)
				}
			}
		}
		k.mu.Unlock()
		if n, streams := k.counts(); n != 200 || streams > 16 {
			t.Errorf("agent %s: %d requests on %d streams, want 200 on at most 16 (streams reused)", k.name, n, streams)
		}
	}

	// The same instance takes pa over on a new session.
	a2 := serveKeepAlive(dialBound(t, e, ha, "pa"), "A2")
	tunneltest.Eventually(t, 10*time.Second, "the old session's idle streams to close", func() bool { return a.open.Load() == 0 })
	before, _ := a.counts()
	for range 20 {
		if got := get(t, c, "pa"); got != "A2" {
			t.Fatalf("pa after the takeover answered by %q, want A2", got)
		}
	}
	if after, _ := a.counts(); after != before {
		t.Errorf("the old session served %d requests after the takeover", after-before)
	}
	if n, _ := a2.counts(); n != 20 {
		t.Errorf("the new session served %d requests, want 20", n)
	}
}

// TestStrayBytesCloseIdleStream: bytes an agent sends on a stream after an
// exchange's answer (here, a whole second response) are never read as the
// next exchange's answer: the edge closes that stream, and the next
// request gets a fresh stream and its own answer.
func TestStrayBytesCloseIdleStream(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = time.Minute
	e := tunneltest.StartEdge(t, cfg)
	r := dialBound(t, e, hello(""), "stray")
	k := serveKeepAliveStray(r, "ok", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
	c := e.Client()
	if got := get(t, c, "stray"); got != "ok" {
		t.Fatalf("first answer %q", got)
	}
	select {
	case <-k.strayed:
	case <-time.After(10 * time.Second):
		t.Fatal("the edge kept a stream that carried bytes outside an exchange")
	}
	for range 3 {
		if got := get(t, c, "stray"); got != "ok" {
			t.Fatalf("answer after the stray bytes %q, want the request's own", got)
		}
	}
	if _, streams := k.counts(); streams != 2 {
		t.Errorf("%d streams, want the closed one and a fresh one", streams)
	}
}

func serveKeepAliveStray(r *tunneltest.RawSession, name, stray string) *keepAliveAgent {
	k := &keepAliveAgent{name: name, hosts: map[uint32][]string{}, strayed: make(chan struct{}), stray: stray}
	return startKeepAlive(r, k)
}

// TestIdlePoolBounded: under 10,000 requests at 256 at once (from four
// visitor addresses, each at the per-address limit) a session's open
// streams stay within the requests in flight and the idle bound, and fall
// to the idle bound when the load ends.
func TestIdlePoolBounded(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	e := tunneltest.StartEdge(t, cfg)
	load(t, e, cfg, 256, 10000)
}

// TestIdleStreamsClose: a session's idle streams are closed once idle for
// IdleStreamTimeout.
func TestIdleStreamsClose(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.IdleStreamTimeout = 200 * time.Millisecond
	e := tunneltest.StartEdge(t, cfg)
	load(t, e, cfg, 16, 500)
	tunneltest.Eventually(t, 10*time.Second, "the idle streams to close", func() bool {
		return scrape(t, e, "")["ngstone_streams_open"] == 0
	})
}

// load sends total GETs, conc at once, through a tunnel of an agent of
// the defaults, and checks the bounds of the session's open streams.
func load(t *testing.T, e *tunneltest.Edge, cfg edge.Config, conc, total int) {
	backend := tunneltest.StartBackend(t)
	acfg := e.AgentConfig("", backend.Addr())
	acfg.Subdomain = "pool"
	tunneltest.StartAgent(t, acfg).WaitOnline(t)
	var clients []*http.Client
	for i := range 4 {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(i+1))}}
		clients = append(clients, &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
			MaxIdleConnsPerHost: conc / 4,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return d.DialContext(ctx, "tcp", e.Addr("http").String())
			},
		}})
	}
	defer func() {
		for _, c := range clients {
			c.CloseIdleConnections()
		}
	}()
	var next, failed atomic.Int64
	var peak atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		var wg sync.WaitGroup
		for w := range conc {
			wg.Go(func() {
				c := clients[w%4]
				for next.Add(1) <= int64(total) {
					resp, err := c.Get(tunneltest.URL("http", "pool", "/hello"))
					if err != nil {
						failed.Add(1)
						continue
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						failed.Add(1)
					}
				}
			})
		}
		wg.Wait()
	}()
	for sampling := true; sampling; {
		select {
		case <-done:
			sampling = false
		case <-time.After(20 * time.Millisecond):
		}
		if n := int64(scrape(t, e, "")["ngstone_streams_open"]); n > peak.Load() {
			peak.Store(n)
		}
	}
	if n := failed.Load(); n > 0 {
		t.Errorf("%d of %d requests failed", n, total)
	}
	// Streams the edge has closed count until the agent's close comes
	// back (within a second): at most as many again as were in flight.
	if p := peak.Load(); p > int64(2*conc+cfg.IdleStreams) || p == 0 {
		t.Errorf("peak of %d open streams, want at most %d in flight, as many closing and %d idle", p, conc, cfg.IdleStreams)
	}
	tunneltest.Eventually(t, 10*time.Second, "the open streams to fall to the idle bound", func() bool {
		return scrape(t, e, "")["ngstone_streams_open"] <= float64(cfg.IdleStreams)
	})
	t.Logf("peak of %d open streams", peak.Load())
}
