package agent

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func testTransport(addr string) *localTransport {
	return &localTransport{
		addr:          addr,
		dialer:        net.Dialer{Timeout: 5 * time.Second},
		headerTimeout: 5 * time.Second,
		maxIdle:       4,
		idleTimeout:   time.Minute,
		probeIdle:     time.Hour,
	}
}

// countingServer is an httptest server that counts the connections it
// accepted.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			n.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &n
}

// do sends one request through tr and returns the status and body.
func do(t *testing.T, tr *localTransport, ctx context.Context, method, url, body string) (int, string, error) {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, r)
	if err != nil {
		t.Fatal(err)
	}
	if r == nil {
		req.Body = nil // as the reverse proxy sends a request without a body
	}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

func TestLocalTransportKeepsConnectionsAlive(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		io.WriteString(w, r.Method+" "+string(b))
	})
	tr := testTransport(s.Listener.Addr().String())
	t.Cleanup(tr.CloseIdleConnections)
	for i := range 20 {
		method, body := "GET", ""
		if i%2 == 1 {
			method, body = "POST", strings.Repeat("x", i*1000)
		}
		code, got, err := do(t, tr, context.Background(), method, s.URL+"/", body)
		if err != nil || code != 200 || got != method+" "+body {
			t.Fatalf("request %d: %d %.20q %v", i, code, got, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("20 requests used %d connections, want 1", n)
	}
}

func TestLocalTransportConnectionClose(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		io.WriteString(w, "bye")
	})
	tr := testTransport(s.Listener.Addr().String())
	t.Cleanup(tr.CloseIdleConnections)
	for i := range 3 {
		if code, got, err := do(t, tr, context.Background(), "GET", s.URL+"/", ""); err != nil || code != 200 || got != "bye" {
			t.Fatalf("request %d: %d %q %v", i, code, got, err)
		}
	}
	if n := conns.Load(); n != 3 {
		t.Errorf("3 requests answered with Connection: close used %d connections, want 3", n)
	}
}

// closingServer answers one request per connection, keep-alive in its
// headers, then closes the connection; closed receives once it has.
func closingServer(t *testing.T) (addr string, accepted *atomic.Int32, closed chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted, closed = new(atomic.Int32), make(chan struct{}, 16)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			req, err := http.ReadRequest(bufio.NewReader(c))
			if err == nil {
				io.Copy(io.Discard, req.Body)
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}
			c.Close()
			closed <- struct{}{}
		}
	})
	return ln.Addr().String(), accepted, closed
}

func TestLocalTransportPeerClosedIdleConnection(t *testing.T) {
	addr, accepted, closed := closingServer(t)
	url := "http://" + addr + "/"
	tr := testTransport(addr)
	t.Cleanup(tr.CloseIdleConnections)
	send := func(method, body string) {
		t.Helper()
		if code, got, err := do(t, tr, context.Background(), method, url, body); err != nil || code != 200 || got != "ok" {
			t.Fatalf("%s: %d %q %v", method, code, got, err)
		}
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			t.Fatal("server did not close the connection")
		}
	}
	send("GET", "")
	// Without a probe, a GET on the dead pooled connection is sent again
	// on a new one.
	send("GET", "")
	// A POST cannot be sent twice: the idle connection is probed first.
	tr.probeIdle = 0
	send("POST", "body")
	if n := accepted.Load(); n != 3 {
		t.Errorf("server accepted %d connections, want 3", n)
	}
}

func TestLocalTransportEarlyResponse(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == "POST" {
			http.Error(w, "too large", http.StatusRequestEntityTooLarge)
			return
		}
		io.WriteString(w, "ok")
	})
	tr := testTransport(s.Listener.Addr().String())
	t.Cleanup(tr.CloseIdleConnections)
	code, _, _ := do(t, tr, context.Background(), "POST", s.URL+"/", strings.Repeat("x", 1<<20))
	if code != http.StatusRequestEntityTooLarge {
		t.Fatalf("POST answered before its body was read: status %d, want 413", code)
	}
	if code, got, err := do(t, tr, context.Background(), "GET", s.URL+"/", ""); err != nil || code != 200 || got != "ok" {
		t.Fatalf("GET after: %d %q %v", code, got, err)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("%d connections, want 2: the one whose request body was cut short is not reused", n)
	}
}

func TestLocalTransportInformational(t *testing.T) {
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</app.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		io.WriteString(w, "final")
	})
	tr := testTransport(s.Listener.Addr().String())
	t.Cleanup(tr.CloseIdleConnections)
	var got []int
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			if h.Get("Link") == "" {
				t.Errorf("%d without its Link header", code)
			}
			got = append(got, code)
			return nil
		},
	})
	code, body, err := do(t, tr, ctx, "GET", s.URL+"/", "")
	if err != nil || code != 200 || body != "final" {
		t.Fatalf("%d %q %v", code, body, err)
	}
	if len(got) != 1 || got[0] != http.StatusEarlyHints {
		t.Errorf("informational responses %v, want [103]", got)
	}
}

// silentServer reads requests and never answers.
func silentServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() { io.Copy(io.Discard, c) })
		}
	})
	return ln.Addr().String()
}

func TestLocalTransportTimeoutAndCancel(t *testing.T) {
	addr := silentServer(t)
	tr := testTransport(addr)
	t.Cleanup(tr.CloseIdleConnections)
	tr.headerTimeout = 50 * time.Millisecond
	_, _, err := do(t, tr, context.Background(), "GET", "http://"+addr+"/", "")
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("no response headers within the timeout: %v, want a timeout", err)
	}

	tr.headerTimeout = time.Minute
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	start := time.Now()
	_, _, err = do(t, tr, ctx, "POST", "http://"+addr+"/", "body")
	if !errors.Is(err, context.Canceled) || time.Since(start) > 5*time.Second {
		t.Errorf("canceled request: %v after %v, want context.Canceled at once", err, time.Since(start))
	}
}
