package agent_test

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// workers counts the goroutines that serve a session's streams.
func workers() int { return strings.Count(tunneltest.Stacks(), "agent.(*workers).work(") }

// TestWorkersFollowLoad: the goroutines serving a session's streams grow
// with the streams served at once, shrink once idle to the one that waits
// for the next, and that one still serves it.
func TestWorkersFollowLoad(t *testing.T) {
	const burst = 8
	hold := make(chan struct{})
	entered := make(chan struct{}, burst)
	local := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			entered <- struct{}{}
			select {
			case <-hold:
			case <-time.After(20 * time.Second):
			}
		}
		io.WriteString(w, "ok")
	})}
	e := serveLocal(t, local, "burst")
	c := e.Client()
	defer c.CloseIdleConnections()

	var visits sync.WaitGroup
	codes := make(chan int, burst)
	for range burst {
		visits.Go(func() {
			resp, err := c.Get(tunneltest.URL("https", "burst", "/hold"))
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	for range burst {
		select {
		case <-entered:
		case <-time.After(10 * time.Second):
			t.Fatal("the burst never reached the local service")
		}
	}
	if n := workers(); n < burst+1 {
		t.Errorf("%d workers with %d streams in flight, want one more waiting", n, burst)
	}
	close(hold)
	visits.Wait()
	close(codes)
	for code := range codes {
		if code != 200 {
			t.Errorf("a held request got %d", code)
		}
	}
	tunneltest.Eventually(t, 15*time.Second, "idle workers to end but one", func() bool { return workers() == 1 })
	resp, err := c.Get(tunneltest.URL("https", "burst", "/after"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("after the idle workers ended: %d", resp.StatusCode)
	}
}
