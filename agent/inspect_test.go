package agent

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
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
}
