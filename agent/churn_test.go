package agent_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestResetsUnderLoad: visitors keep sending GETs and 64 KiB POSTs while
// the agent's connection is reset again and again. Every request gets the
// local service's answer, or an error the edge made up with its code
// (tunnel_interrupted for a request the reset cut, tunnel_offline while the
// agent is away), or, once its response had started, a response cut short.
// None hangs, none meets a connection the edge closed without an answer,
// none gets another body, and afterwards the tunnel serves under its name
// with the goroutines back to their level.
func TestResetsUnderLoad(t *testing.T) {
	b := tunneltest.StartBackend(t)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	p := newProxy(t, e)
	ac := e.AgentConfig(p.Addr(), b.Addr())
	ac.Subdomain = "churn"
	a := tunneltest.StartAgent(t, ac)
	st := a.WaitOnline(t)
	c := e.Client()
	defer c.CloseIdleConnections()
	base := tunneltest.Goroutines()

	body := bytes.Repeat([]byte("0123456789abcdef"), 4<<10) // 64 KiB
	var (
		ok, cut, coded atomic.Int64
		mu             sync.Mutex
		defects        []string
	)
	defect := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(defects) < 10 {
			defects = append(defects, fmt.Sprintf(format, args...))
		}
	}
	visit := func(post bool) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", tunneltest.URL("https", "churn", "/hello"), nil)
		want := []byte("hello")
		if post {
			req, _ = http.NewRequestWithContext(ctx, "POST", tunneltest.URL("https", "churn", "/echo"), bytes.NewReader(body))
			want = body
		}
		resp, err := c.Do(req)
		if err != nil {
			defect("%s %s: no response: %v", req.Method, req.URL.Path, err)
			return
		}
		defer resp.Body.Close()
		got, err := io.ReadAll(resp.Body)
		code := resp.Header.Get(mux.ErrorHeader)
		switch {
		case err != nil && ctx.Err() != nil:
			defect("%s %s: %d, body still unread after 10s", req.Method, req.URL.Path, resp.StatusCode)
		case err != nil:
			cut.Add(1) // the response had started: aborted, never ended short
		case resp.StatusCode == 200 && code == "" && bytes.Equal(got, want):
			ok.Add(1)
		case resp.StatusCode == 502 && code == string(mux.CodeTunnelInterrupted),
			resp.StatusCode == 503 && code == string(mux.CodeTunnelOffline):
			coded.Add(1)
		default:
			defect("%s %s: %d %s=%q, %d bytes", req.Method, req.URL.Path, resp.StatusCode, mux.ErrorHeader, code, len(got))
		}
	}

	stop := make(chan struct{})
	var visitors sync.WaitGroup
	for i := range 4 {
		visitors.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				visit((i+n)%2 == 1)
			}
		})
	}
	for range 15 {
		// Some requests through the current session, then a reset.
		served := ok.Load()
		tunneltest.Eventually(t, 10*time.Second, "requests served", func() bool { return ok.Load() >= served+10 })
		p.Reset()
		prev := st.SessionID
		st = a.WaitStatus(t, 10*time.Second, "online on a new session", func(s agent.Status) bool {
			return s.State == agent.StateOnline && s.SessionID != prev
		})
	}
	close(stop)
	visitors.Wait()
	t.Logf("%d answered by the local service, %d answered by the edge with a code, %d cut short", ok.Load(), coded.Load(), cut.Load())
	for _, d := range defects {
		t.Error(d)
	}
	if code, body := quickGet(c, tunneltest.URL("https", "churn", "/hello")); code != 200 || body != "hello" {
		t.Fatalf("after the resets: %d %q", code, body)
	}
	c.CloseIdleConnections()
	// The agent's idle connections to the local service (one per visitor
	// at most) are kept, not leaked: end them from the service's side.
	b.CloseClientConnections()
	// Abandoned sessions drain and close in the background: under load
	// that took more than 5s once in about forty runs. A leak never ends.
	deadline := time.Now().Add(15 * time.Second)
	for tunneltest.Goroutines() > base+5 {
		if time.Now().After(deadline) {
			buf := make([]byte, 256<<10)
			n := runtime.Stack(buf, true)
			t.Fatalf("%d goroutines 15s after the load, against %d before it:\n%s", tunneltest.Goroutines(), base, buf[:n])
		}
		time.Sleep(10 * time.Millisecond)
	}
}
