package edge_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// visitorFrom is a client of e's listeners whose connections come from
// the loopback address src. With proxy set, each connection first sends a
// PROXY protocol header (v1, or v2 for version 2) naming proxy as the
// visitor, as a load balancer does.
func visitorFrom(t *testing.T, e *tunneltest.Edge, src string, proxy string, version byte, h2 bool) *http.Client {
	t.Helper()
	d := &net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			_, port, _ := net.SplitHostPort(addr)
			target := e.Addr("http").String()
			if port == "443" {
				target = e.Addr("https").String()
			}
			c, err := d.DialContext(ctx, network, target)
			if err != nil || proxy == "" {
				return c, err
			}
			from := net.TCPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(proxy), 40000))
			hdr := proxyproto.HeaderProxyFromAddrs(version, from, c.RemoteAddr())
			if _, err := hdr.WriteTo(c); err != nil {
				c.Close()
				return nil, err
			}
			return c, nil
		},
		TLSClientConfig:   &tls.Config{RootCAs: e.Roots},
		ForceAttemptHTTP2: h2,
		DisableKeepAlives: true,
	}
	if !h2 {
		tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// seen is what one visit got: the status, the Ngstone-Error code, the
// protocol, and the X-Forwarded-For the local service saw.
type seen struct {
	status int
	code   string
	proto  string
	xff    string
}

func visitHeaders(c *http.Client, url string) (seen, error) {
	resp, err := c.Get(url)
	if err != nil {
		return seen{}, err
	}
	defer resp.Body.Close()
	s := seen{status: resp.StatusCode, code: resp.Header.Get(mux.ErrorHeader), proto: resp.Proto}
	if resp.StatusCode == http.StatusOK {
		var got struct{ Header http.Header }
		if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
			return s, err
		}
		s.xff = got.Header.Get("X-Forwarded-For")
	} else {
		io.Copy(io.Discard, resp.Body)
	}
	return s, nil
}

// TestVisitorCIDR: a tunnel's --allow-cidr and --deny-cidr, enforced by
// the edge before a request crosses: over HTTP/1.1, HTTPS and HTTP/2, a
// visitor from 127.0.0.2 (allowed) reaches the local service, one from
// 127.0.0.3 (outside the allow list) gets 403 ip_denied; behind a trusted
// load balancer (127.0.0.4) the address its PROXY header gives (v1 and
// v2, IPv4 and IPv6) is the visitor's, for the lists and for
// X-Forwarded-For, and the deny list wins inside an allowed prefix; a PROXY
// header from any other source is refused, as is a trusted source's
// connection without one. Another tunnel on the same edge, without lists,
// lets everyone in.
func TestVisitorCIDR(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.ProxyProtocol = true
	cfg.ProxyProtocolFrom = []netip.Prefix{netip.MustParsePrefix("127.0.0.4/32")}
	cfg.ReadHeaderTimeout = time.Minute // far past the visitors' 10 s
	e := tunneltest.StartEdge(t, cfg)
	b := tunneltest.StartBackend(t)
	ac := e.AgentConfig("", b.Addr())
	ac.Subdomain = "guarded"
	ac.AllowCIDR = []string{"127.0.0.2/32", "198.51.100.0/24", "2001:db8::/32"}
	ac.DenyCIDR = []string{"198.51.100.66/32"}
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	open := e.AgentConfig("", b.Addr())
	open.Subdomain = "open"
	tunneltest.StartAgent(t, open).WaitOnline(t)

	type visitor struct {
		src, proxy string
		version    byte
		want       int    // 0: the connection is refused
		xff        string // what the local service sees
	}
	visitors := []visitor{
		{src: "127.0.0.2", want: http.StatusOK, xff: "127.0.0.2"},
		{src: "127.0.0.3", want: http.StatusForbidden},
		{src: "127.0.0.4", proxy: "198.51.100.7", version: 1, want: http.StatusOK, xff: "198.51.100.7"},
		{src: "127.0.0.4", proxy: "198.51.100.7", version: 2, want: http.StatusOK, xff: "198.51.100.7"},
		{src: "127.0.0.4", proxy: "2001:db8::7", version: 2, want: http.StatusOK, xff: "2001:db8::7"},
		{src: "127.0.0.4", proxy: "198.51.100.66", version: 2, want: http.StatusForbidden},
		{src: "127.0.0.4", proxy: "127.0.0.3", version: 1, want: http.StatusForbidden},
		{src: "127.0.0.4", proxy: "", want: 0},                      // trusted, but no header
		{src: "127.0.0.3", proxy: "127.0.0.2", version: 1, want: 0}, // untrusted header
		{src: "127.0.0.5", proxy: "127.0.0.2", version: 2, want: 0},
	}
	// A load balancer's connection that has not sent its header yet holds
	// up nobody: the header is read on the connection's own goroutine.
	for _, l := range []string{"http", "https"} {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.4")}}
		silent, err := d.Dial("tcp", e.Addr(l).String())
		if err != nil {
			t.Fatal(err)
		}
		defer silent.Close()
	}
	denied := 0.0
	diff, _ := delta(t, e, func() {
		for _, v := range visitors {
			for _, url := range []string{tunneltest.URL("http", "guarded", "/headers"), tunneltest.URL("https", "guarded", "/headers")} {
				for _, h2 := range []bool{false, true} {
					if h2 && strings.HasPrefix(url, "http:") {
						continue
					}
					what := fmt.Sprintf("%s from %s (PROXY %q v%d, h2 %v)", url, v.src, v.proxy, v.version, h2)
					got, err := visitHeaders(visitorFrom(t, e, v.src, v.proxy, v.version, h2), url)
					switch {
					case v.want == 0:
						if err == nil {
							t.Errorf("%s: %d, want the connection refused", what, got.status)
						}
						continue
					case err != nil:
						t.Errorf("%s: %v", what, err)
						continue
					case got.status != v.want:
						t.Errorf("%s: %d %s, want %d", what, got.status, got.code, v.want)
					case v.want == http.StatusForbidden && got.code != mux.CodeIPDenied:
						t.Errorf("%s: Ngstone-Error %q, want %s", what, got.code, mux.CodeIPDenied)
					case v.want == http.StatusOK && got.xff != v.xff:
						t.Errorf("%s: the local service saw X-Forwarded-For %q, want %q", what, got.xff, v.xff)
					case h2 && got.proto != "HTTP/2.0":
						t.Errorf("%s: spoke %s, want HTTP/2.0", what, got.proto)
					}
					if v.want == http.StatusForbidden {
						denied++
					}
				}
			}
		}
		got, err := visitHeaders(visitorFrom(t, e, "127.0.0.3", "", 0, true), tunneltest.URL("https", "open", "/headers"))
		if err != nil || got.status != http.StatusOK {
			t.Errorf("a tunnel without lists, from 127.0.0.3: %+v, %v; want 200", got, err)
		}
	})
	wantEqual(t, diff, `ngstone_limits_total{limit="ip_denied"}`, denied)
}

// TestVisitorCIDRInCluster: the lists are enforced by the edge holding the
// tunnel for visitors that come in at another edge of the cluster, by the
// address that edge saw; a visitor's own X-Forwarded-For changes nothing.
func TestVisitorCIDRInCluster(t *testing.T) {
	c := newTestCluster(t)
	a, b := c.start("a", nil, nil), c.start("b", nil, nil)
	backend := tunneltest.StartBackend(t)
	ac := a.AgentConfig("", backend.Addr())
	ac.Subdomain = "guarded"
	ac.DenyCIDR = []string{"127.0.0.3/32"}
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	url := tunneltest.URL("https", "guarded", "/headers")
	tunneltest.Eventually(t, 5*time.Second, "b to route guarded", func() bool {
		_, ok := b.store.Lookup("guarded." + tunneltest.Domain)
		return ok
	})
	for _, src := range []string{"127.0.0.2", "127.0.0.3"} {
		req, _ := http.NewRequest("GET", url, nil)
		req.Header.Set("X-Forwarded-For", "127.0.0.2")
		resp, err := visitorFrom(t, b.Edge, src, "", 0, true).Do(req)
		if err != nil {
			t.Fatalf("from %s through b: %v", src, err)
		}
		resp.Body.Close()
		want := http.StatusOK
		if src == "127.0.0.3" {
			want = http.StatusForbidden
		}
		if resp.StatusCode != want || (want == http.StatusForbidden && resp.Header.Get(mux.ErrorHeader) != mux.CodeIPDenied) {
			t.Errorf("from %s through b: %d %s, want %d", src, resp.StatusCode, resp.Header.Get(mux.ErrorHeader), want)
		}
	}
}

// TestVisitorCIDRRefusedBinds: prefixes the edge cannot read, or that
// are no prefix of either family (IPv4-mapped, under 96 bits), are refused
// with the bind, by the agent before it connects and by the edge from a
// hand-made bind.
func TestVisitorCIDRRefusedBinds(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	ac := e.AgentConfig("", "127.0.0.1:1")
	// A prefix in IPv4-mapped form of fewer than 96 bits reaches past the
	// mapped addresses: it is no IPv4 prefix.
	for _, p := range []string{"10.0.0.300/8", "::ffff:0.0.0.0/95", "::ffff:10.0.0.0/8"} {
		ac.AllowCIDR = []string{p}
		if _, err := agent.New(ac, tunneltest.Logger()); err == nil || !strings.Contains(err.Error(), "allow-cidr") {
			t.Errorf("agent with the prefix %s: %v, want refused naming allow-cidr", p, err)
		}
	}
	raw, _ := e.DialRaw(t, hello(""))
	for _, bind := range []*mux.Bind{
		{Subdomain: "x", DenyCIDR: []string{"not a prefix"}},
		{Subdomain: "x", DenyCIDR: []string{"::ffff:0.0.0.0/80"}},
		{Subdomain: "x", AllowCIDR: make([]string, 2000)},
	} {
		for i := range bind.AllowCIDR {
			bind.AllowCIDR[i] = "10.0.0.0/8"
		}
		be, ok := raw.Bind(t, bind).(*mux.BindError)
		if !ok || be.Code != mux.CodeBadRequest {
			t.Errorf("bind %d allow, %v deny: %+v, want %s", len(bind.AllowCIDR), bind.DenyCIDR, be, mux.CodeBadRequest)
		}
	}
	if _, err := edge.New(func() edge.Config {
		cfg := tunneltest.EdgeConfig(t)
		cfg.ProxyProtocol = true
		return cfg
	}(), tunneltest.Logger()); err == nil || !strings.Contains(err.Error(), "proxy-protocol-from") {
		t.Errorf("proxy protocol with no trusted source: %v, want refused naming proxy-protocol-from", err)
	}
}

// TestVisitorCIDRMappedForm: a prefix written in IPv4-mapped form
// (::ffff:127.0.0.3/128) means the IPv4 prefix (127.0.0.3/32), which the
// edge matches the visitor's address against: a deny list in that form
// keeps its visitor out (it let everyone in), and an allow list lets its
// visitor in and no other (it kept everyone out).
func TestVisitorCIDRMappedForm(t *testing.T) {
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	b := tunneltest.StartBackend(t)
	for name, set := range map[string]func(*agent.Config){
		"deny":  func(c *agent.Config) { c.DenyCIDR = []string{"::ffff:127.0.0.3/128"} },
		"allow": func(c *agent.Config) { c.AllowCIDR = []string{"::ffff:127.0.0.2/128"} },
		"wide":  func(c *agent.Config) { c.DenyCIDR = []string{"::ffff:127.0.0.0/104"} },
	} {
		ac := e.AgentConfig("", b.Addr())
		ac.Subdomain = name
		set(&ac)
		tunneltest.StartAgent(t, ac).WaitOnline(t)
	}
	for _, c := range []struct {
		name, src string
		want      int
	}{
		{"deny", "127.0.0.2", http.StatusOK}, {"deny", "127.0.0.3", http.StatusForbidden},
		{"allow", "127.0.0.2", http.StatusOK}, {"allow", "127.0.0.3", http.StatusForbidden},
		{"wide", "127.0.0.2", http.StatusForbidden},
	} {
		got, err := visitHeaders(visitorFrom(t, e, c.src, "", 0, false), tunneltest.URL("http", c.name, "/headers"))
		if err != nil || got.status != c.want {
			t.Errorf("%s from %s: %+v %v, want %d", c.name, c.src, got, err, c.want)
		}
	}
}
