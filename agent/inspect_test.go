package agent

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/conntest"
	"github.com/ngstone/ngstone/mux"
)

// TestInspector: the inspector keeps each exchange as it crossed the agent
// (heads, the start of each body, sizes), lists them newest first, replays
// a request whose body it kept whole to the local service, and refuses to
// replay one it did not, or one a cross-site page asks for.
func TestInspector(t *testing.T) {
	var mu sync.Mutex
	var seen []string // method, path and body of each request the local service got
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+" "+strconv.Itoa(len(b)))
		mu.Unlock()
		io.WriteString(w, "answer to "+r.URL.Path)
	})
	a := relayAgentWith(t, s.URL, Config{InspectAddr: "127.0.0.1:0"}, slog.New(slog.DiscardHandler))
	h := a.inspect.Handler()
	api := func(method, path string, hdr ...string) (int, []byte) {
		t.Helper()
		req := httptest.NewRequest(method, path, nil)
		req.Host = "127.0.0.1:4040"
		for i := 0; i+1 < len(hdr); i += 2 {
			if hdr[i] == "Host" {
				req.Host = hdr[i+1]
				continue
			}
			req.Header.Set(hdr[i], hdr[i+1])
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code, rec.Body.Bytes()
	}

	req, _ := http.NewRequest("POST", "http://app.ngstone.test/hook?x=1", strings.NewReader(`{"event":"paid"}`))
	relayOnce(t, a, req)
	big := bytes.Repeat([]byte("b"), 100<<10)
	req, _ = http.NewRequest("PUT", "http://app.ngstone.test/big", bytes.NewReader(big))
	req.ContentLength = -1 // chunked, streamed by the body goroutine
	relayOnce(t, a, req)
	req, _ = http.NewRequest("GET", "http://app.ngstone.test/page", nil)
	relayOnce(t, a, req)

	// An exchange whose request body was still streaming when it ended is
	// kept once the body is done.
	deadline := time.Now().Add(5 * time.Second)
	for len(a.inspect.list()) < 3 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	code, body := api("GET", "/api/requests")
	var list []Capture
	if err := json.Unmarshal(body, &list); err != nil || code != 200 || len(list) != 3 {
		t.Fatalf("/api/requests: %d %v %s", code, err, body)
	}
	// Newest first, by when they were kept.
	slices.SortFunc(list, func(a, b Capture) int { return b.Start.Compare(a.Start) })
	get, put, post := list[0], list[1], list[2]
	if get.Method != "GET" || get.Path != "/page" || get.Status != 200 || string(get.Response.Body) != "answer to /page" ||
		!strings.HasPrefix(get.Response.Head, "HTTP/1.1 200") || !strings.HasPrefix(get.Request.Head, "GET /page HTTP/1.1\r\n") {
		t.Errorf("GET capture: %+v", get)
	}
	if post.Method != "POST" || post.Path != "/hook?x=1" || string(post.Request.Body) != `{"event":"paid"}` || post.Request.Truncated || post.Request.Size != 16 {
		t.Errorf("POST capture: %+v", post)
	}
	if !put.Request.Truncated || put.Request.Size != int64(len(big)) || len(put.Request.Body) != inspectBodyMax || put.Status != 200 {
		t.Errorf("PUT capture of a 100 KiB chunked body: truncated %v size %d kept %d status %d", put.Request.Truncated, put.Request.Size, len(put.Request.Body), put.Status)
	}

	code, body = api("POST", "/api/requests/"+strconv.FormatUint(post.ID, 10)+"/replay")
	var again Capture
	if err := json.Unmarshal(body, &again); err != nil || code != 200 || !again.Replay || again.Status != 200 || string(again.Response.Body) != "answer to /hook" {
		t.Fatalf("replay: %d %v %s", code, err, body)
	}
	mu.Lock()
	if last := seen[len(seen)-1]; last != "POST /hook 16" {
		t.Errorf("the local service got %q for the replay, want the POST again with its 16 bytes", last)
	}
	n := len(seen)
	mu.Unlock()
	if code, body = api("POST", "/api/requests/"+strconv.FormatUint(put.ID, 10)+"/replay"); code != http.StatusConflict || !bytes.Contains(body, []byte("not kept whole")) {
		t.Errorf("replay of a truncated body: %d %s", code, body)
	}
	for _, hdr := range [][]string{
		{"Sec-Fetch-Site", "cross-site"}, {"Sec-Fetch-Site", "same-site"},
		{"Origin", "http://evil.example"}, {"Origin", "http://127.0.0.1:9999"},
	} {
		if code, _ = api("POST", "/api/requests/"+strconv.FormatUint(post.ID, 10)+"/replay", hdr...); code != http.StatusForbidden {
			t.Errorf("replay with %s: %d, want 403", hdr, code)
		}
	}
	if code, _ = api("POST", "/api/requests/"+strconv.FormatUint(post.ID, 10)+"/replay", "Origin", "http://127.0.0.1:4040"); code != 200 {
		t.Errorf("replay from the inspector's own origin: %d, want 200", code)
	}
	mu.Lock()
	if len(seen) != n+1 {
		t.Errorf("the local service saw %v after the refused replays and one from the inspector's origin", seen[n:])
	}
	mu.Unlock()
	if code, _ = api("GET", "/api/requests/999"); code != 404 {
		t.Errorf("unknown id: %d", code)
	}
	if code, body = api("GET", "/"); code != 200 || !bytes.Contains(body, []byte("ngstone inspector")) {
		t.Errorf("page: %d", code)
	}
	// A name rebound to 127.0.0.1 by another site reads nothing.
	for _, host := range []string{"attacker.example:4040", "attacker.example"} {
		if code, _ = api("GET", "/api/requests", "Host", host); code != http.StatusForbidden {
			t.Errorf("Host %s: %d, want 403", host, code)
		}
	}
	for _, host := range []string{"localhost:4040", "[::1]:4040", "127.0.0.1:4040"} {
		if code, _ = api("GET", "/api/requests", "Host", host); code != 200 {
			t.Errorf("Host %s: %d, want 200", host, code)
		}
	}
}

// TestInspectorKeepsTheLast: the oldest exchange goes when the inspector
// holds inspectKeep.
func TestInspectorKeepsTheLast(t *testing.T) {
	in := newInspector(nil)
	for i := range inspectKeep + 5 {
		in.add(Capture{Path: "/" + strconv.Itoa(i)})
	}
	l := in.list()
	if len(l) != inspectKeep || l[0].Path != "/"+strconv.Itoa(inspectKeep+4) || l[len(l)-1].Path != "/5" {
		t.Fatalf("kept %d, newest %q, oldest %q", len(l), l[0].Path, l[len(l)-1].Path)
	}
	if _, ok := in.get(1); ok {
		t.Fatal("the first exchange is still kept")
	}
	// Around the ring more than once: every one of the last inspectKeep,
	// newest first, each found by its id.
	for i := range 2*inspectKeep + 7 {
		in.add(Capture{Path: "/w" + strconv.Itoa(i)})
	}
	l = in.list()
	for i, c := range l {
		if want := "/w" + strconv.Itoa(2*inspectKeep+6-i); c.Path != want {
			t.Fatalf("list[%d] %q, want %q", i, c.Path, want)
		}
		if got, ok := in.get(c.ID); !ok || got.Path != c.Path {
			t.Fatalf("get(%d): %q %v, want %q", c.ID, got.Path, ok, c.Path)
		}
	}
}

// TestInspectorListsByArrival: the list is newest first by when each
// exchange reached the agent, not by when it was kept: a request sent
// after another's answer lists above it even when the first was kept
// last (its stream finished after the visitor had its answer).
func TestInspectorListsByArrival(t *testing.T) {
	in := newInspector(nil)
	t0 := time.Now()
	in.add(Capture{Path: "/second", Start: t0.Add(time.Millisecond)})
	in.add(Capture{Path: "/first", Start: t0})
	in.add(Capture{Path: "/third", Start: t0.Add(2 * time.Millisecond)})
	var got []string
	for _, c := range in.list() {
		got = append(got, c.Path)
	}
	if want := []string{"/third", "/second", "/first"}; !slices.Equal(got, want) {
		t.Fatalf("list %q, want %q", got, want)
	}
}

// TestInspectorHeadsAsTheyCrossed: a head is written when the inspector is
// read, but as it was when it crossed: what changes the request or the
// response afterwards (the response header rules, the reverse proxy's
// removal of hop-by-hop fields) does not show.
func TestInspectorHeadsAsTheyCrossed(t *testing.T) {
	req := httptest.NewRequest("POST", "http://local/p?q=1", strings.NewReader("abc"))
	req.Host = ""
	req.Header = http.Header{"X-B": {"2"}, "X-A": {"1"}}
	resp := &http.Response{ProtoMajor: 1, ProtoMinor: 1, Status: "201 Created", ContentLength: -1,
		TransferEncoding: []string{"chunked"}, Header: http.Header{"Connection": {"keep-alive"}, "X-C": {"3"}}}
	var c capture
	c.request(req)
	c.response(resp)
	req.Header.Set("X-A", "changed")
	resp.Header.Del("Connection")
	resp.Header.Set("X-Rule", "added")
	in := newInspector(nil)
	in.add(Capture{Request: c.req.message(), Response: c.resp.message()})
	got := in.list()[0]
	if want := "POST /p?q=1 HTTP/1.1\r\nHost: \r\nContent-Length: 3\r\nX-A: 1\r\nX-B: 2\r\n\r\n"; got.Request.Head != want {
		t.Errorf("request head %q, want %q", got.Request.Head, want)
	}
	if want := "HTTP/1.1 201 Created\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\nX-C: 3\r\n\r\n"; got.Response.Head != want {
		t.Errorf("response head %q, want %q", got.Response.Head, want)
	}
	if again, _ := in.get(got.ID); again.Request.Head != got.Request.Head || again.Response.Head != got.Response.Head {
		t.Errorf("written twice differently: %q, %q", again.Request.Head, again.Response.Head)
	}
}

// TestInspectorKeepsTheAgentsGRPCAnswer: on both of the agent's paths (its
// own, and the server's it hands a stream to), a gRPC call the agent
// answers itself is kept with the grpc-status its answer carried, and a
// call it relays with the local server's (a response of trailers only),
// as is a replay of that call.
func TestInspectorKeepsTheAgentsGRPCAnswer(t *testing.T) {
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set("Grpc-Status", "5") // NOT_FOUND, as a gRPC server answers with trailers only
	}))
	t.Cleanup(local.Close)
	locked := Config{InspectAddr: "127.0.0.1:0", Tunnel: Tunnel{BasicAuth: []string{"alice:correct horse"}}}
	for _, tc := range []struct {
		name, local string
		cfg         Config
		want        string
	}{
		{"down", conntest.DeadAddr(t), Config{InspectAddr: "127.0.0.1:0"}, "14"},
		{"locked", local.URL, locked, "16"},
		{"relayed", local.URL, Config{InspectAddr: "127.0.0.1:0"}, "5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := relayAgentWith(t, tc.local, tc.cfg, slog.New(slog.DiscardHandler))
			req, _ := http.NewRequest("POST", "http://app.ngstone.test/pkg.Svc/Call", strings.NewReader("\x00\x00\x00\x00\x00"))
			req.Header.Set("Content-Type", "application/grpc")
			req.Header.Set("Te", "trailers")
			resp, _, err := relayOnce(t, a, req)
			if err != nil {
				t.Fatal(err)
			}
			kept := a.inspect.list() // kept before the stream is let go
			if len(kept) != 1 {
				t.Fatalf("kept %d exchanges, want 1", len(kept))
			}
			if got := resp.Header.Get("Grpc-Status"); got != tc.want || kept[0].GRPCStatus != got {
				t.Fatalf("answered grpc-status %q, kept %q; want %s", got, kept[0].GRPCStatus, tc.want)
			}
			if tc.name != "relayed" {
				return
			}
			id, err := a.inspect.replay(t.Context(), kept[0], false)
			if again, _ := a.inspect.get(id); err != nil || again.GRPCStatus != tc.want {
				t.Fatalf("the replay kept grpc-status %q (%v), want %s", again.GRPCStatus, err, tc.want)
			}
		})
	}
}

// inspectorAPI calls h as a browser on the inspector's own page would.
func inspectorAPI(t *testing.T, h http.Handler, method, path string, body io.Reader, hdr ...string) (int, http.Header, []byte) {
	t.Helper()
	req := httptest.NewRequest(method, path, body)
	req.Host = "127.0.0.1:4040"
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Code, rec.Header(), rec.Body.Bytes()
}

// TestInspectorEditAndReplay: a replay after editing sends the edited head
// and body to the local service (Content-Length from the body), is kept
// and marked as edited, listed among the console's requests and logged;
// edits the agent cannot send, or that another site asks for, reach
// nothing.
func TestInspectorEditAndReplay(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.RequestURI()+" "+r.Header.Get("X-Edited")+" "+strconv.FormatInt(r.ContentLength, 10)+" "+string(b))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write([]byte{0, 1, 2, 0xff, '<', 's', '>'})
	})
	var logs logBuffer
	a := relayAgentWith(t, s.URL, Config{InspectAddr: "127.0.0.1:0"}, slog.New(slog.NewJSONHandler(&logs, nil)))
	h := a.inspect.Handler()
	req, _ := http.NewRequest("POST", "http://app.ngstone.test/hook", strings.NewReader(`{"event":"paid"}`))
	relayOnce(t, a, req)
	orig := a.inspect.list()[0]

	edit := `{"head": "PUT /hook?edited=1 HTTP/1.1\nHost: app.ngstone.test\nX-Edited: yes\nContent-Length: 999\n", "body": "` + base64.StdEncoding.EncodeToString([]byte(`{"event":"refunded"}`)) + `"}`
	code, _, body := inspectorAPI(t, h, "POST", "/api/requests/"+strconv.FormatUint(orig.ID, 10)+"/replay", strings.NewReader(edit), "Content-Type", "application/json")
	var got Capture
	if err := json.Unmarshal(body, &got); err != nil || code != 200 || !got.Replay || !got.Edited || got.ReplayOf != orig.ID || got.Method != "PUT" {
		t.Fatalf("edited replay: %d %v %s", code, err, body)
	}
	mu.Lock()
	if last := seen[len(seen)-1]; last != `PUT /hook?edited=1 yes 20 {"event":"refunded"}` {
		t.Errorf("the local service got %q", last)
	}
	n := len(seen)
	mu.Unlock()
	if st := a.Stats(); len(st.Recent) < 2 || !st.Recent[0].Replay || st.Recent[0].Method != "PUT" || st.Recent[0].Status != 200 {
		t.Errorf("console's requests: %+v", st.Recent)
	}
	if l := logs.line("replay", "/hook?edited=1"); l == nil || l["edited"] != true || l["of"] != float64(orig.ID) {
		t.Errorf("replay not logged: %s", logs.String())
	}

	// The binary response: a download that is neither rendered nor sniffed.
	code, hdr, body := inspectorAPI(t, h, "GET", "/api/requests/"+strconv.FormatUint(got.ID, 10)+"/response/body", nil)
	if code != 200 || !bytes.Equal(body, []byte{0, 1, 2, 0xff, '<', 's', '>'}) || hdr.Get("Content-Type") != "application/octet-stream" ||
		hdr.Get("X-Content-Type-Options") != "nosniff" || !strings.HasPrefix(hdr.Get("Content-Disposition"), "attachment") || hdr.Get("Content-Security-Policy") != "sandbox" {
		t.Errorf("body download: %d %v %q", code, hdr, body)
	}
	if code, _, _ := inspectorAPI(t, h, "GET", "/api/requests/"+strconv.FormatUint(got.ID, 10)+"/other/body", nil); code != 404 {
		t.Errorf("download of another side: %d", code)
	}

	id := strconv.FormatUint(orig.ID, 10)
	for _, bad := range []struct {
		name, body string
		hdr        []string
		status     int
	}{
		{"not JSON", "head=GET", nil, 400},
		{"not a request head", `{"head": "hello world"}`, nil, 400},
		{"a body over 64 KiB", `{"body": "` + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte("x"), inspectBodyMax+1)) + `"}`, nil, 400},
		{"over the size limit", `{"head": "` + strings.Repeat("a", mux.MaxRequestHead+inspectBodyMax*2) + `"}`, nil, 400},
		{"from another site", edit, []string{"Sec-Fetch-Site", "cross-site"}, 403},
		{"from another origin", edit, []string{"Origin", "http://evil.example"}, 403},
	} {
		code, _, body := inspectorAPI(t, h, "POST", "/api/requests/"+id+"/replay", strings.NewReader(bad.body), bad.hdr...)
		if code != bad.status {
			t.Errorf("%s: %d %s, want %d", bad.name, code, body, bad.status)
		}
	}
	mu.Lock()
	if len(seen) != n {
		t.Errorf("refused edits reached the local service: %v", seen[n:])
	}
	mu.Unlock()
}

// TestInspectorPortRange: with its port taken the inspector takes the next
// free one of its range; the whole range taken, or a single address taken,
// is EADDRINUSE (TestAgentInspectorRange: what the agent does then).
func TestInspectorPortRange(t *testing.T) {
	var held []net.Listener
	t.Cleanup(func() {
		for _, l := range held {
			l.Close()
		}
	})
	// Three consecutive free ports, the first two taken.
	base := consecutivePorts(t, 3)
	for i := range 2 {
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(base+i))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, ln)
	}
	addr := "127.0.0.1:" + strconv.Itoa(base)
	ln, err := listenRange(addr, 2)
	if err != nil || ln.Addr().String() != "127.0.0.1:"+strconv.Itoa(base+2) {
		t.Fatalf("range of 3 with 2 taken: %v %v", ln, err)
	}
	held = append(held, ln)
	if _, err := listenRange(addr, 2); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("the whole range taken: %v", err)
	}
	if _, err := listenRange(addr, 0); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("a single address taken: %v", err)
	}

}

// consecutivePorts finds n free consecutive loopback ports.
func consecutivePorts(t *testing.T, n int) int {
	t.Helper()
	for try := 0; try < 100; try++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		ok := base+n <= 65535
		for i := 1; ok && i < n; i++ {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(base+i))
			if err != nil {
				ok = false
				break
			}
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("no free consecutive ports")
	return 0
}

// logBuffer collects JSON log lines.
type logBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// line returns the first log line with msg for path.
func (b *logBuffer) line(msg, path string) map[string]any {
	for l := range strings.Lines(b.String()) {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg && m["path"] == path {
			return m
		}
	}
	return nil
}
