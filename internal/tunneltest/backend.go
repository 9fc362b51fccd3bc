package tunneltest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/conntest"
)

// Pattern writes n deterministic bytes, so bodies can be checked byte for byte.
func Pattern(n int64) io.Reader {
	return io.LimitReader(&patternReader{}, n)
}

// patternReader's bytes depend on their offset in the stream alone, not on
// how it is read.
type patternReader struct{ off int64 }

func (r *patternReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte((r.off+int64(i))*7 + 3)
	}
	r.off += int64(len(p))
	return len(p), nil
}

// Backend is a local service with the endpoints the tests need:
//
//	/hello             200 "hello"
//	/echo              the request body back
//	/download?n=N      N pattern bytes
//	/headers           the request's headers and Host as JSON
//	/sse?n=N           N server-sent events, each sent after the previous
//	                   one's ack arrived on /sse-ack
//	/upgrade           101 Switching Protocols, then echoes bytes
//	/slow              blocks until Release, then 200 "slow done"
//	/hang              never answers (until the client gives up)
type Backend struct {
	*httptest.Server
	// Entered receives a value when /slow starts.
	Entered chan struct{}
	release chan struct{}
	sseAck  chan struct{}
}

// StartBackend starts a backend closed at the end of the test.
func StartBackend(t testing.TB) *Backend {
	b := &Backend{Entered: make(chan struct{}, 16), release: make(chan struct{}), sseAck: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("/hello", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") })
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).EnableFullDuplex()
		w.Header().Set("Content-Type", "application/octet-stream")
		io.Copy(w, r.Body)
	})
	mux.HandleFunc("/sink", func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body) // all of it, before the answer
		io.WriteString(w, strconv.FormatInt(n, 10))
	})
	mux.HandleFunc("/download", func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		io.Copy(w, Pattern(n))
	})
	mux.HandleFunc("/headers", func(w http.ResponseWriter, r *http.Request) {
		h := map[string]any{"host": r.Host, "header": r.Header}
		json.NewEncoder(w).Encode(h)
	})
	mux.HandleFunc("/sse", b.sse)
	mux.HandleFunc("/sse-ack", func(w http.ResponseWriter, r *http.Request) {
		select {
		case b.sseAck <- struct{}{}:
		case <-r.Context().Done():
		}
	})
	mux.HandleFunc("/upgrade", upgrade)
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		b.Entered <- struct{}{}
		select {
		case <-b.release:
			io.WriteString(w, "slow done")
		case <-r.Context().Done():
		}
	})
	mux.HandleFunc("/hang", func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	b.Server = httptest.NewServer(mux)
	t.Cleanup(func() {
		b.Server.CloseClientConnections()
		b.Server.Close()
	})
	return b
}

// Release lets every /slow request (now and later) answer.
func (b *Backend) Release() { close(b.release) }

// Addr is the backend's HOST:PORT.
func (b *Backend) Addr() string { return b.Listener.Addr().String() }

func (b *Backend) sse(w http.ResponseWriter, r *http.Request) {
	n, _ := strconv.Atoi(r.URL.Query().Get("n"))
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	for i := range n {
		fmt.Fprintf(w, "data: event %d\n\n", i)
		rc.Flush()
		if i == n-1 {
			return
		}
		select {
		case <-b.sseAck:
		case <-r.Context().Done():
			return
		case <-time.After(10 * time.Second):
			return
		}
	}
}

func upgrade(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Upgrade") != "ngstone-test" {
		http.Error(w, "want Upgrade: ngstone-test", http.StatusBadRequest)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: ngstone-test\r\n\r\n")
	brw.Flush()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	line, err := brw.ReadString('\n')
	if err != nil {
		return
	}
	io.WriteString(conn, "echo: "+line)
}

// UpgradeRoundTrip sends an Upgrade request for NAME.Domain/upgrade to the
// plain-HTTP listener at addr, checks the 101, and exchanges one line over
// the upgraded connection with the backend's echo.
func UpgradeRoundTrip(t testing.TB, addr, name string) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(conn, "GET /upgrade HTTP/1.1\r\nHost: "+name+"."+Domain+"\r\nConnection: Upgrade\r\nUpgrade: ngstone-test\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade via %s: %v, %v; want 101", addr, resp, err)
	}
	io.WriteString(conn, "ping\n")
	if line, err := br.ReadString('\n'); err != nil || line != "echo: ping\n" {
		t.Fatalf("after the upgrade: %q %v", line, err)
	}
}

// ServeConns serves each connection to a loopback listener with serve
// (closing it after, or when the test ends), and returns its address.
func ServeConns(t testing.TB, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conntest.Serve(t, ln, serve)
	return ln.Addr().String()
}
