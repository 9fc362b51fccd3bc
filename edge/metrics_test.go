package edge_test

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// scrape reads the edge's /metrics and returns each sample by its series
// as exposed: `name{label="value",...}` (labels in exposition order).
func scrape(t *testing.T, e *tunneltest.Edge, token string) map[string]float64 {
	t.Helper()
	req, _ := http.NewRequest("GET", "http://"+e.Addr("admin").String()+"/metrics", nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /metrics: status %d", resp.StatusCode)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

// delta scrapes before and after f and returns after-before for each series.
func delta(t *testing.T, e *tunneltest.Edge, f func()) (diff, after map[string]float64) {
	t.Helper()
	before := scrape(t, e, "")
	f()
	after = scrape(t, e, "")
	diff = map[string]float64{}
	for k, v := range after {
		diff[k] = v - before[k]
	}
	return diff, after
}

func wantAtLeast(t *testing.T, m map[string]float64, series string, min float64) {
	t.Helper()
	if v, ok := m[series]; !ok || v < min {
		t.Errorf("%s = %v (present %v), want >= %v", series, v, ok, min)
	}
}

func wantEqual(t *testing.T, m map[string]float64, series string, want float64) {
	t.Helper()
	if v, ok := m[series]; !ok || v != want {
		t.Errorf("%s = %v (present %v), want %v", series, v, ok, want)
	}
}

// startTunnel starts an edge, a backend and an agent bound to name.
func startTunnel(t *testing.T, name string) (*tunneltest.Edge, *tunneltest.Backend, *tunneltest.Agent) {
	t.Helper()
	cfg := tunneltest.EdgeConfig(t)
	cfg.Version, cfg.Commit = "v1.2.3-test", "abc123"
	e := tunneltest.StartEdge(t, cfg)
	b := tunneltest.StartBackend(t)
	acfg := e.AgentConfig("", b.Addr())
	acfg.Subdomain = name
	a := tunneltest.StartAgent(t, acfg)
	a.WaitOnline(t)
	return e, b, a
}

func client(t *testing.T, e *tunneltest.Edge) *http.Client {
	c := e.Client()
	t.Cleanup(c.CloseIdleConnections)
	return c
}

func TestMetricsVisitorRequests(t *testing.T) {
	e, _, _ := startTunnel(t, "app")
	c := client(t, e)
	body := strings.Repeat("x", 1000)
	d, after := delta(t, e, func() {
		for _, r := range []struct {
			method, url string
			want        int
		}{
			{"GET", tunneltest.URL("http", "app", "/hello"), 200},
			{"GET", tunneltest.URL("https", "app", "/hello"), 200},
			{"POST", tunneltest.URL("http", "app", "/echo"), 200},
			{"GET", tunneltest.URL("http", "nobody", "/"), 404},
		} {
			req, _ := http.NewRequest(r.method, r.url, nil)
			if r.method == "POST" {
				req.Body = io.NopCloser(strings.NewReader(body))
				req.ContentLength = int64(len(body))
			}
			resp, err := c.Do(req)
			if err != nil {
				t.Fatalf("%s %s: %v", r.method, r.url, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != r.want {
				t.Fatalf("%s %s: status %d, want %d", r.method, r.url, resp.StatusCode, r.want)
			}
		}
	})
	wantEqual(t, d, `ngstone_visitor_requests_total{class="2xx",error_code=""}`, 3)
	wantEqual(t, d, `ngstone_visitor_requests_total{class="4xx",error_code="tunnel_not_found"}`, 1)
	wantEqual(t, d, `ngstone_visitor_request_duration_seconds_count{class="2xx"}`, 3)
	wantEqual(t, d, `ngstone_visitor_received_bytes_total`, 1000)
	// hello twice, the echoed body, the 404's sentence.
	wantAtLeast(t, d, `ngstone_visitor_sent_bytes_total`, 2*5+1000+10)
	wantEqual(t, after, `ngstone_sessions_active`, 1)
	wantEqual(t, after, `ngstone_tunnels_active`, 1)
	wantEqual(t, after, `ngstone_streams_active`, 0)
	wantEqual(t, after, `ngstone_binds_total{result="ok"}`, 1)
}

func TestMetricsActiveStreams(t *testing.T) {
	e, b, _ := startTunnel(t, "slow")
	c := client(t, e)
	done := make(chan int, 1)
	go func() {
		resp, err := c.Get(tunneltest.URL("http", "slow", "/slow"))
		if err != nil {
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	select {
	case <-b.Entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the slow request never reached the backend")
	}
	wantEqual(t, scrape(t, e, ""), "ngstone_streams_active", 1)
	b.Release()
	if code := <-done; code != 200 {
		t.Fatalf("slow request: status %d", code)
	}
	tunneltest.Eventually(t, 5*time.Second, "streams_active back to 0", func() bool {
		return scrape(t, e, "")["ngstone_streams_active"] == 0
	})
}

func TestMetricsUpgradedBytes(t *testing.T) {
	e, _, _ := startTunnel(t, "ws")
	d, _ := delta(t, e, func() {
		tunneltest.UpgradeRoundTrip(t, e.Addr("http").String(), "ws")
		// The request is counted when the proxy's handler returns.
		tunneltest.Eventually(t, 5*time.Second, "the upgraded request counted", func() bool {
			return scrape(t, e, "")[`ngstone_visitor_requests_total{class="1xx",error_code=""}`] == 1
		})
	})
	wantEqual(t, d, `ngstone_visitor_requests_total{class="1xx",error_code=""}`, 1)
	wantAtLeast(t, d, `ngstone_visitor_received_bytes_total`, 5) // "ping\n"
	wantAtLeast(t, d, `ngstone_visitor_sent_bytes_total`, 11)    // "echo: ping\n"
}

func TestMetricsBindRefused(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.Tokens = []string{"good"}
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "team", Subdomains: []string{"team-*"}}}
	e := tunneltest.StartEdge(t, cfg)
	b := tunneltest.StartBackend(t)
	holder := e.AgentConfig("", b.Addr())
	holder.Token, holder.Subdomain = "good", "held"
	tunneltest.StartAgent(t, holder).WaitOnline(t)

	for _, tc := range []struct {
		name, token, subdomain, result string
	}{
		{"reserved name", "good", "admin", "reserved_name"},
		{"subdomain taken", "good", "held", "subdomain_taken"},
		{"unauthorized", "bad", "other", "unauthorized"},
		{"token may not bind the name", "team", "other", "unauthorized"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, _ := delta(t, e, func() {
				cfg := e.AgentConfig("", b.Addr())
				cfg.Token, cfg.Subdomain = tc.token, tc.subdomain
				a := tunneltest.StartAgent(t, cfg)
				var re *agent.RefusedError
				select {
				case <-a.Done():
				case <-time.After(10 * time.Second):
					t.Fatal("the refused agent did not stop")
				}
				if err := a.Err(); !errors.As(err, &re) || re.Code != tc.result {
					t.Fatalf("agent: %v, want refused with %s", err, tc.result)
				}
			})
			wantEqual(t, d, `ngstone_binds_total{result="`+tc.result+`"}`, 1)
			wantEqual(t, d, `ngstone_binds_total{result="ok"}`, 0)
		})
	}
	// The agent checks names itself; a bare session shows the edge does too.
	t.Run("invalid name", func(t *testing.T) {
		d, _ := delta(t, e, func() {
			_, ctrl := dialBareToken(t, e, agent.NewInstanceID(), "good")
			mux.Write(ctrl, &mux.Bind{Subdomain: "-bad-"})
			m, err := mux.Read(ctrl)
			if be, ok := m.(*mux.BindError); err != nil || !ok || be.Code != mux.CodeInvalidName {
				t.Fatalf("bind -bad-: %#v %v", m, err)
			}
		})
		wantEqual(t, d, `ngstone_binds_total{result="invalid_name"}`, 1)
	})
}

// TestMetricsEviction: a bare session of instance X holds app; an agent of
// the same instance takes it over (rule 1), so the bare session is evicted,
// fenced and, holding nothing else, drained and closed by the edge. (Two
// live agents of one instance would take the name from each other forever.)
func TestMetricsEviction(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	b := tunneltest.StartBackend(t)
	id := agent.NewInstanceID()
	ys, ctrl := dialBare(t, e, id)
	if err := mux.Write(ctrl, &mux.Bind{Subdomain: "app"}); err != nil {
		t.Fatal(err)
	}
	if m, err := mux.Read(ctrl); err != nil || m.MessageType() != mux.TypeBindOK {
		t.Fatalf("bind: %v %v", m, err)
	}
	d, after := delta(t, e, func() {
		cfg := e.AgentConfig("", b.Addr())
		cfg.Subdomain, cfg.InstanceID = "app", id
		tunneltest.StartAgent(t, cfg).WaitOnline(t)
		select {
		case <-ys.CloseChan():
		case <-time.After(10 * time.Second):
			t.Fatal("the edge did not close the evicted session")
		}
		tunneltest.Eventually(t, 5*time.Second, "the evicted session ended", func() bool {
			return scrape(t, e, "")["ngstone_sessions_active"] == 1
		})
	})
	wantEqual(t, d, `ngstone_evictions_total`, 1)
	wantEqual(t, d, `ngstone_binds_total{result="takeover"}`, 1)
	wantEqual(t, d, `ngstone_session_ends_total{cause="evicted"}`, 1)
	wantEqual(t, after, `ngstone_tunnels_active`, 1)
}

// dialBare connects to the edge's control listener as a minimal agent of
// instance id: TLS, yamux, control stream, hello. It never heartbeats.
func dialBare(t *testing.T, e *tunneltest.Edge, id string) (*yamux.Session, net.Conn) {
	t.Helper()
	return dialBareToken(t, e, id, "")
}

func dialBareToken(t *testing.T, e *tunneltest.Edge, id, token string) (*yamux.Session, net.Conn) {
	t.Helper()
	r, m := e.DialRaw(t, &mux.Hello{Version: mux.Version, InstanceID: id, Token: token})
	if m.MessageType() != mux.TypeHelloOK {
		t.Fatalf("hello: %v", m)
	}
	return r.YS, r.Ctrl
}

// TestMetricsSessionEndHeartbeatTimeout connects a bare agent that says
// hello and then never heartbeats: the edge reaps it.
func TestMetricsSessionEndHeartbeatTimeout(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.HeartbeatTimeout = 200 * time.Millisecond
	e := tunneltest.StartEdge(t, cfg)
	d, _ := delta(t, e, func() {
		ys, _ := dialBare(t, e, agent.NewInstanceID())
		select {
		case <-ys.CloseChan():
		case <-time.After(10 * time.Second):
			t.Fatal("the edge never closed the silent session")
		}
		tunneltest.Eventually(t, 5*time.Second, "the session end counted", func() bool {
			return scrape(t, e, "")[`ngstone_session_ends_total{cause="heartbeat_timeout"}`] >= 1
		})
	})
	wantEqual(t, d, `ngstone_session_ends_total{cause="heartbeat_timeout"}`, 1)
	wantEqual(t, d, `ngstone_session_ends_total{cause="closed"}`, 0)
}

func TestMetricsSessionEndClosed(t *testing.T) {
	e, _, a := startTunnel(t, "app")
	d, after := delta(t, e, func() {
		a.Stop()
		tunneltest.Eventually(t, 5*time.Second, "the session ended", func() bool {
			return scrape(t, e, "")["ngstone_sessions_active"] == 0
		})
	})
	wantEqual(t, d, `ngstone_session_ends_total{cause="closed"}`, 1)
	wantEqual(t, after, `ngstone_tunnels_active`, 0)
}

func TestMetricsCertificateAndBuildInfo(t *testing.T) {
	e, _, _ := startTunnel(t, "app")
	m := scrape(t, e, "")
	exp, ok := m[`ngstone_certificate_expiry_timestamp_seconds{name="`+tunneltest.Domain+`"}`]
	if !ok {
		t.Fatalf("no expiry series for %s; have %v", tunneltest.Domain, seriesNamed(m, "ngstone_certificate"))
	}
	if now := float64(time.Now().Unix()); exp <= now || exp > now+10*365*24*3600 {
		t.Errorf("certificate expiry %v is not a plausible future time (now %v)", exp, now)
	}
	wantEqual(t, m, "ngstone_certificate_earliest_expiry_timestamp_seconds", exp)
	wantEqual(t, m, "ngstone_certificates", 1)
	var found bool
	for k, v := range m {
		if strings.HasPrefix(k, "ngstone_build_info{") && strings.Contains(k, `version="v1.2.3-test"`) && strings.Contains(k, `commit="abc123"`) && strings.Contains(k, `goversion="go`) && v == 1 {
			found = true
		}
	}
	if !found {
		t.Errorf("no ngstone_build_info with the configured version; have %v", seriesNamed(m, "ngstone_build_info"))
	}
	for k := range m {
		if strings.Contains(k, tunneltest.Domain) && !strings.HasPrefix(k, "ngstone_certificate_expiry_timestamp_seconds{") {
			t.Errorf("series %s carries a hostname", k)
		}
	}
}

func seriesNamed(m map[string]float64, prefix string) []string {
	var out []string
	for k := range m {
		if strings.HasPrefix(k, prefix) {
			out = append(out, k)
		}
	}
	return out
}
