package main

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestHTTPFloor: the HTTP floor's two sides, over real TLS and yamux,
// relay requests with their Host and body and the responses back, keep
// connections to the backend open from one request to the next, and stop
// when their context ends.
func TestHTTPFloor(t *testing.T) {
	var mu sync.Mutex
	conns := map[string]bool{}
	be := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns[r.RemoteAddr] = true
		mu.Unlock()
		b, _ := io.ReadAll(r.Body)
		io.WriteString(w, r.Host+" "+string(b))
	})}
	bl := listen(t)
	go be.Serve(bl)
	defer be.Close()

	visitors, cancel, done := startFloor(t, httpEdge, httpAgent, bl.Addr().String())
	defer cancel()

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	post := func(body string) (int, string) {
		req, _ := http.NewRequest("POST", "http://"+visitors+"/", strings.NewReader(body))
		req.Host = "floor.test"
		resp, err := client.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// Until the agent's session is there, the edge answers 502.
	deadline := time.Now().Add(10 * time.Second)
	for code, _ := post("x"); code != http.StatusOK; code, _ = post("x") {
		if time.Now().After(deadline) {
			t.Fatal("the HTTP floor did not answer 200 within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	const requests = 20
	for i := range requests {
		body := strings.Repeat("b", i*1000)
		if code, got := post(body); code != http.StatusOK || got != "floor.test "+body {
			t.Fatalf("request %d: %d %.40q, want 200 and the Host and body back", i, code, got)
		}
	}
	mu.Lock()
	n := len(conns)
	mu.Unlock()
	// One, but for a request that comes before the transport has put the
	// connection of the one before back in its pool, which a loaded
	// machine makes likely: the transport then dials another.
	if n > requests/4 {
		t.Errorf("the backend saw %d connections for %d requests one after another: not kept open", n, requests)
	}
	tr.CloseIdleConnections()
	cancel()
	waitCanceled(t, done, 2)
}
