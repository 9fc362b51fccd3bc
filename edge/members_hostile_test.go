package edge_test

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
	"github.com/oauth2-proxy/mockoidc"
)

// Attacks on pools (edge/members.go, registry/pool.go): a hostile agent, a
// hostile visitor, a hostile local service and a careless operator each
// try to break what a pool promises.

// rawMember is a raw agent's part in a pool: it serves every stream the
// edge opens as keep-alive HTTP/1.1, answers each request with answer
// (nil: 200 and its name) and counts what reached it, by Host.
type rawMember struct {
	name   string
	answer func(w io.Writer, name string)

	mu     sync.Mutex
	hosts  map[string]int
	bodies int // requests that carried a body
}

func serveMember(r *tunneltest.RawSession, name string, answer func(w io.Writer, name string)) *rawMember {
	return serveMemberSeeing(r, name, answer, nil)
}

// serveMemberSeeing is serveMember that also shows each request, its body
// read, to seen (nil: none) before answering it.
func serveMemberSeeing(r *tunneltest.RawSession, name string, answer func(w io.Writer, name string), seen func(*http.Request)) *rawMember {
	if answer == nil {
		answer = answerOK
	}
	m := &rawMember{name: name, answer: answer, hosts: map[string]int{}}
	go func() {
		for {
			st, err := r.YS.AcceptStream()
			if err != nil {
				return
			}
			go func() {
				defer st.Close()
				br := bufio.NewReader(st)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					n, _ := io.Copy(io.Discard, req.Body)
					m.mu.Lock()
					m.hosts[req.Host]++
					if n > 0 {
						m.bodies++
					}
					m.mu.Unlock()
					if seen != nil {
						seen(req)
					}
					m.answer(st, m.name)
				}
			}()
		}
	}()
	return m
}

// total is how many requests reached m, for any Host.
func (m *rawMember) total() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, c := range m.hosts {
		n += c
	}
	return n
}

// served is how many requests for host reached m.
func (m *rawMember) served(host string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.hosts[host]
}

func answerOK(w io.Writer, name string) {
	fmt.Fprintf(w, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(name), name)
}

// answerUnsent is what a member's agent answers when its local service
// accepts no connection (or what a lying agent, or a local service, says):
// the edge may send the request, if it has no body, to another member.
func answerUnsent(w io.Writer, name string) {
	fmt.Fprintf(w, "HTTP/1.1 502 Bad Gateway\r\n%s: %s\r\n%s: 1\r\nContent-Length: %d\r\n\r\n%s",
		mux.ErrorHeader, mux.CodeUpstreamUnreachable, mux.UnsentHeader, len(name), name)
}

// rawPoolEdge is an edge for raw agents (which send no heartbeats) of two
// tokens, its registry in a file.
func rawPoolEdge(t *testing.T) *tunneltest.Edge {
	return tunneltest.StartEdge(t, rawPoolConfig(t))
}

func rawPoolConfig(t *testing.T) edge.Config {
	cfg := poolEdgeConfig(t)
	cfg.HeartbeatTimeout = time.Minute // raw agents send none
	cfg.Tokens = []string{"alpha", "beta"}
	return cfg
}

// joinPool opens a raw session with h and binds sub with b's settings and
// Pool; it returns the session and its id.
func joinPool(t *testing.T, e *tunneltest.Edge, h *mux.Hello, sub string, b mux.Bind) (*tunneltest.RawSession, uint64) {
	t.Helper()
	r, m := e.DialRaw(t, h)
	ok, isOK := m.(*mux.HelloOK)
	if !isOK {
		t.Fatalf("hello: %+v", m)
	}
	b.Subdomain, b.Pool = sub, true
	if m, isOK := r.Bind(t, &b).(*mux.BindOK); !isOK {
		t.Fatalf("bind %s with pool: %+v", sub, m)
	}
	return r, ok.SessionID
}

// sameInstance is a hello of h's instance with token.
func sameInstance(h *mux.Hello, token string) *mux.Hello {
	return &mux.Hello{Version: mux.Version, InstanceID: h.InstanceID, Token: token}
}

// reply is one visitor's answer.
type reply struct {
	status int
	code   string // Ngstone-Error
	body   string
	unsent bool // Ngstone-Unsent reached the visitor
}

func ask(t *testing.T, c *http.Client, req *http.Request) reply {
	t.Helper()
	got, err := tryDo(c, req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	return got
}

func tryDo(c *http.Client, req *http.Request) (reply, error) {
	resp, err := c.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	_, unsent := resp.Header[mux.UnsentHeader]
	return reply{status: resp.StatusCode, code: resp.Header.Get(mux.ErrorHeader), body: string(b), unsent: unsent}, err
}

func getPool(t *testing.T, c *http.Client, sub string) reply {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, tunneltest.URL("http", sub, "/"), nil)
	return ask(t, c, req)
}

// readUntil reads r's control messages until want holds, at most 1000.
func readUntil(t *testing.T, r *tunneltest.RawSession, what string, want func(mux.Message) bool) {
	t.Helper()
	for range 1000 {
		if want(r.Read(t)) {
			return
		}
	}
	t.Fatalf("no %s in 1000 control messages", what)
}

// exchange sends m on r's control stream and reads until want holds (a
// bind_error fails it), within 10 s; for a goroutine other than the test's.
func exchange(r *tunneltest.RawSession, m mux.Message, want func(mux.Message) bool) error {
	if err := mux.Write(r.Ctrl, m); err != nil {
		return err
	}
	r.Ctrl.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer r.Ctrl.SetReadDeadline(time.Time{})
	for range 1000 {
		got, err := mux.Read(r.Ctrl)
		switch {
		case err != nil:
			return err
		case want(got):
			return nil
		case got.MessageType() == mux.TypeBindError:
			return fmt.Errorf("%+v", got)
		}
	}
	return fmt.Errorf("no answer to %s in 1000 messages", m.MessageType())
}

// countingHandler counts the edge's log records of pool member health, and
// the bytes of their reasons.
type countingHandler struct {
	records, reasonBytes atomic.Int64
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "pool member health" {
		return nil
	}
	h.records.Add(1)
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "reason" {
			h.reasonBytes.Add(int64(len(a.Value.String())))
		}
		return true
	})
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

// startEdgeLogged is tunneltest.StartEdge with the edge's logs to log.
func startEdgeLogged(t *testing.T, cfg edge.Config, log *slog.Logger) *tunneltest.Edge {
	t.Helper()
	e, err := edge.New(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	pem, err := os.ReadFile(e.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	return &tunneltest.Edge{Edge: e, Config: cfg, Roots: roots}
}

// A hostile agent's health messages: for a pool of another token, names
// it does not hold (in another case, of no one, empty, a TCP key), a
// name it holds without --pool, reasons of 60 KB, thousands of them. They
// touch no other session's members, count nowhere but its own pool
// member, are kept and logged at most 200 bytes each, and a repeated one
// is logged once; the edge reads on (a heartbeat after them is answered).
func TestPoolHostileHealth(t *testing.T) {
	logs := &countingHandler{}
	e := startEdgeLogged(t, rawPoolConfig(t), slog.New(logs))
	host := "hp." + tunneltest.Domain
	ra, _ := joinPool(t, e, hello("alpha"), "hp", mux.Bind{})
	rb, _ := joinPool(t, e, hello("alpha"), "hp", mux.Bind{})
	a, b := serveMember(ra, "A", nil), serveMember(rb, "B", nil)
	x, _ := joinPool(t, e, hello("beta"), "xp", mux.Bind{})
	if m, ok := x.Bind(t, &mux.Bind{Subdomain: "xs"}).(*mux.BindOK); !ok {
		t.Fatalf("bind xs: %+v", m)
	}
	serveMember(x, "X", nil)
	xp, xs := "xp."+tunneltest.Domain, "xs."+tunneltest.Domain
	huge := "x" + strings.Repeat("é", 30000) // 60 KB, under the control frame's 64 KiB
	send := func(m *mux.Health) {
		t.Helper()
		if err := mux.Write(x.Ctrl, m); err != nil {
			t.Fatalf("write health: %v", err)
		}
	}
	others := []string{host, "HP." + tunneltest.Domain, "nobody." + tunneltest.Domain, "", "tcp:1", xs}
	for _, h := range others {
		send(&mux.Health{Hostname: h, Down: true, Reason: huge})
	}
	for i := range 3000 {
		send(&mux.Health{Hostname: others[i%len(others)], Down: i%2 == 0, Reason: "flood"})
	}
	sync := func(seq uint64) {
		t.Helper()
		// Everything before a heartbeat was read once it is answered.
		if err := mux.Write(x.Ctrl, &mux.Heartbeat{Seq: seq}); err != nil {
			t.Fatal(err)
		}
		readUntil(t, x, "heartbeat_ack", func(m mux.Message) bool {
			ack, ok := m.(*mux.HeartbeatAck)
			return ok && ack.Seq == seq
		})
	}
	sync(1)
	before := logs.records.Load()
	for range 500 {
		send(&mux.Health{Hostname: xp, Down: true, Reason: huge})
	}
	send(&mux.Health{Hostname: xs, Down: true, Reason: "not a pool member"})
	send(&mux.Health{}) // the empty message: no hostname
	sync(2)

	if n := logs.records.Load() - before; n > 1 {
		t.Errorf("500 identical health messages logged %d times, want once", n)
	}
	if n, bytes := logs.records.Load(), logs.reasonBytes.Load(); bytes > 200*n {
		t.Errorf("%d health records logged %d bytes of reasons, want at most 200 each", n, bytes)
	}
	tn := poolTunnel(t, e, host)
	if len(tn.Members) != 2 || tn.Members[0].Down != "" || tn.Members[1].Down != "" {
		t.Fatalf("another session's health changed the pool of %s: %+v", host, tn)
	}
	xt := poolTunnel(t, e, xp)
	if len(xt.Members) != 1 || xt.Members[0].Down == "" || len(xt.Members[0].Down) > 200 {
		t.Fatalf("its own member: %+v, want down with at most 200 bytes of reason", xt)
	}
	wantEqual(t, scrape(t, e, ""), "ngstone_pool_members_down", 1)

	c := e.Client()
	for range 60 {
		if got := getPool(t, c, "hp"); got.status != http.StatusOK {
			t.Fatalf("GET hp after the flood: %+v", got)
		}
	}
	if a.served(host) == 0 || b.served(host) == 0 {
		t.Fatalf("after the flood, A served %d and B %d of 60: both must", a.served(host), b.served(host))
	}
	// Its own member only: down, it is the whole pool's 503.
	if got := getPool(t, c, "xp"); got.status != http.StatusServiceUnavailable || got.code != mux.CodeTunnelOffline {
		t.Fatalf("GET xp, its only member down: %+v, want 503 tunnel_offline", got)
	}
	send(&mux.Health{Hostname: xp})
	tunneltest.Eventually(t, 5*time.Second, "xp back up", func() bool {
		return getPool(t, c, "xp").status == http.StatusOK
	})
	wantEqual(t, scrape(t, e, ""), "ngstone_pool_members_down", 0)
}

// An agent of another token never joins a pool, nor takes a member over
// with a member's instance id; nor does the pool's own token without
// --pool, or with another protocol. The members and their generations
// are as before, and both still serve.
func TestPoolForeignAgentsCannotJoinOrTakeOver(t *testing.T) {
	e := rawPoolEdge(t)
	host := "tp." + tunneltest.Domain
	ha := hello("alpha")
	ra, _ := joinPool(t, e, ha, "tp", mux.Bind{})
	rb, _ := joinPool(t, e, hello("alpha"), "tp", mux.Bind{})
	// A's session also holds a pool of its own alone: no other member
	// being live, only the rules of its own decide.
	if m, ok := ra.Bind(t, &mux.Bind{Subdomain: "tp1", Pool: true}).(*mux.BindOK); !ok {
		t.Fatalf("bind tp1: %+v", m)
	}
	a, b := serveMember(ra, "A", nil), serveMember(rb, "B", nil)
	before, alone := poolTunnel(t, e, host), poolTunnel(t, e, "tp1."+tunneltest.Domain)

	for _, tc := range []struct {
		what  string
		h     *mux.Hello
		bind  mux.Bind
		other bool
	}{
		{"another token with the member's instance id and --pool, a pool of one", sameInstance(ha, "beta"), mux.Bind{Subdomain: "tp1", Pool: true, Takeover: true}, true},
		{"another token with the member's instance id, a pool of one", sameInstance(ha, "beta"), mux.Bind{Subdomain: "tp1", Takeover: true}, true},
		{"another token with --pool", hello("beta"), mux.Bind{Pool: true}, true},
		{"another token without --pool", hello("beta"), mux.Bind{Takeover: true}, true},
		{"another token with a member's instance id and --pool", sameInstance(ha, "beta"), mux.Bind{Pool: true, Takeover: true}, true},
		{"another token with a member's instance id", sameInstance(ha, "beta"), mux.Bind{Takeover: true}, true},
		{"the token without --pool", hello("alpha"), mux.Bind{}, false},
		{"a member's own instance without --pool", sameInstance(ha, "alpha"), mux.Bind{Takeover: true}, false},
		{"a member's own instance, TLS passthrough", sameInstance(ha, "alpha"), mux.Bind{Pool: true, Proto: mux.ProtoTLS, Takeover: true}, false},
	} {
		r, m := e.DialRaw(t, tc.h)
		if _, ok := m.(*mux.HelloOK); !ok {
			t.Fatalf("%s: hello %+v", tc.what, m)
		}
		if tc.bind.Subdomain == "" {
			tc.bind.Subdomain = "tp"
		}
		got := r.Bind(t, &tc.bind)
		be, ok := got.(*mux.BindError)
		if !ok || be.Code != mux.CodeSubdomainTaken || be.By == nil || !be.By.Pool || be.By.OtherToken != tc.other {
			t.Fatalf("%s: %+v, want subdomain_taken by a pool (other token %v)", tc.what, got, tc.other)
		}
		r.YS.Close()
	}
	if now := poolTunnel(t, e, "tp1."+tunneltest.Domain); len(now.Members) != 1 || now.Members[0].Generation != alone.Members[0].Generation {
		t.Fatalf("the pool of one changed: %+v, was %+v", now, alone)
	}
	after := poolTunnel(t, e, host)
	if len(after.Members) != 2 {
		t.Fatalf("pool after the refusals: %+v", after)
	}
	for i, m := range after.Members {
		if m.SessionID != before.Members[i].SessionID || m.Generation != before.Members[i].Generation {
			t.Fatalf("member %d changed: %+v, was %+v", i, m, before.Members[i])
		}
	}
	c := e.Client()
	for range 40 {
		if got := getPool(t, c, "tp"); got.status != http.StatusOK {
			t.Fatalf("GET tp: %+v", got)
		}
	}
	if a.served(host) == 0 || b.served(host) == 0 {
		t.Fatalf("A served %d, B %d of 40: both must", a.served(host), b.served(host))
	}
}

// A member's own instance reconnecting takes its member over (rule 1):
// the old session, fenced, which still holds another name, gets no
// request of the pool after it is told, whatever it sends (health that
// says it is up, an unbind), and the pool keeps the new session and the
// other member.
func TestPoolFencedMemberGetsNoRequests(t *testing.T) {
	e := rawPoolEdge(t)
	host := "fp." + tunneltest.Domain
	ha := hello("alpha")
	r1, _ := joinPool(t, e, ha, "fp", mux.Bind{})
	if m, ok := r1.Bind(t, &mux.Bind{Subdomain: "fpkeep"}).(*mux.BindOK); !ok {
		t.Fatalf("bind fpkeep: %+v", m)
	}
	a1 := serveMember(r1, "A1", nil)
	rb, sb := joinPool(t, e, hello("alpha"), "fp", mux.Bind{})
	b := serveMember(rb, "B", nil)
	c := e.Client()
	tunneltest.Eventually(t, 10*time.Second, "A1 to serve fp", func() bool {
		getPool(t, c, "fp")
		return a1.served(host) > 0
	})

	r2, s2 := joinPool(t, e, sameInstance(ha, "alpha"), "fp", mux.Bind{Takeover: true})
	a2 := serveMember(r2, "A2", nil)
	readUntil(t, r1, "evicted for fp", func(m mux.Message) bool {
		ev, ok := m.(*mux.Evicted)
		return ok && ev.Hostname == host
	})
	// The fenced session insists.
	for _, m := range []mux.Message{&mux.Health{Hostname: host}, &mux.Unbind{Hostname: host}, &mux.Heartbeat{Seq: 1}} {
		if err := mux.Write(r1.Ctrl, m); err != nil {
			t.Fatal(err)
		}
	}
	readUntil(t, r1, "heartbeat_ack", func(m mux.Message) bool { _, ok := m.(*mux.HeartbeatAck); return ok })
	fenced := a1.served(host)
	for range 60 {
		if got := getPool(t, c, "fp"); got.status != http.StatusOK || got.body == "A1" {
			t.Fatalf("GET fp after the takeover: %+v", got)
		}
	}
	if n := a1.served(host); n != fenced {
		t.Fatalf("the fenced session got %d requests of fp after it was told", n-fenced)
	}
	if a2.served(host) == 0 || b.served(host) == 0 {
		t.Fatalf("A2 served %d, B %d: both must", a2.served(host), b.served(host))
	}
	if got := getPool(t, c, "fpkeep"); got.body != "A1" {
		t.Fatalf("GET fpkeep, the fenced session's other name: %+v", got)
	}
	tn := poolTunnel(t, e, host)
	if len(tn.Members) != 2 || tn.Members[0].SessionID != s2 || tn.Members[1].SessionID != sb {
		t.Fatalf("pool %+v, want sessions [%d %d]", tn.Members, s2, sb)
	}
}

// A local service that answers 502 upstream_unreachable with
// Ngstone-Unsent (which its agent passes on as it would any field) makes
// the edge send a request without a body to each other member once at
// most, never a request with a body; Ngstone-Unsent reaches no visitor,
// on the final answer nor on an informational one.
func TestPoolForgedUnsentIsBounded(t *testing.T) {
	e := tunneltest.StartEdge(t, poolEdgeConfig(t))
	host := "forge." + tunneltest.Domain
	var hits, bodies atomic.Int64
	for range 3 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			if n, _ := io.Copy(io.Discard, r.Body); n > 0 {
				bodies.Add(1)
			}
			if r.URL.Path == "/early" {
				w.Header().Set(mux.UnsentHeader, "1")
				w.Header().Set("Link", "</style.css>; rel=preload")
				w.WriteHeader(http.StatusEarlyHints)
			}
			w.Header().Set(mux.ErrorHeader, mux.CodeUpstreamUnreachable)
			w.Header().Set(mux.UnsentHeader, "1")
			w.WriteHeader(http.StatusBadGateway)
		})}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		poolAgent(t, e, e.AgentConfig("", ln.Addr().String()), "forge")
	}
	if tn := poolTunnel(t, e, host); len(tn.Members) != 3 {
		t.Fatalf("pool %+v, want 3 members", tn)
	}
	c := e.Client()
	const n = 20
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, tunneltest.URL("https", "forge", "/"), nil)
			if got, err := tryDo(c, req); err != nil || got.status != http.StatusBadGateway || got.unsent {
				t.Errorf("GET: %+v %v, want the 502 without %s", got, err, mux.UnsentHeader)
			}
		})
	}
	wg.Wait()
	if got := hits.Load(); got != 3*n {
		t.Fatalf("%d GETs reached the services %d times, want each member once: %d", n, got, 3*n)
	}
	hits.Store(0)
	for range n {
		req, _ := http.NewRequest(http.MethodPost, tunneltest.URL("https", "forge", "/"), strings.NewReader("payload"))
		if got := ask(t, c, req); got.status != http.StatusBadGateway || got.unsent {
			t.Fatalf("POST: %+v, want the 502 without %s", got, mux.UnsentHeader)
		}
	}
	if got, b := hits.Load(), bodies.Load(); got != n || b != n {
		t.Fatalf("%d POSTs reached the services %d times (%d with the body), want once each", n, got, b)
	}
	var early []textproto.MIMEHeader
	var mu sync.Mutex
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
			mu.Lock()
			early = append(early, h)
			mu.Unlock()
			return nil
		},
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, tunneltest.URL("https", "forge", "/early"), nil)
	if got := ask(t, c, req); got.status != http.StatusBadGateway || got.unsent {
		t.Fatalf("GET /early: %+v", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(early) == 0 {
		t.Fatal("no 103 reached the visitor: the test checks nothing")
	}
	for _, h := range early {
		if _, ok := h[mux.UnsentHeader]; ok {
			t.Fatalf("an informational response reached the visitor with %s: %v", mux.UnsentHeader, h)
		}
	}
}

// hmacSig signs body for --verify-webhook hmac.
func hmacSig(secret, body string) string {
	m := hmac.New(sha256.New, []byte(secret))
	io.WriteString(m, body)
	return hex.EncodeToString(m.Sum(nil))
}

// A request whose member found its service unreachable goes on only to a
// member that lets in the same visitors by the same checks: never to one
// with other --allow-cidr/--deny-cidr rules, nor another webhook secret,
// which the edge did not check it against. Members with the same rules
// take it (the control: a retry happens at all).
func TestPoolRetryKeepsVisitorRules(t *testing.T) {
	e := rawPoolEdge(t)
	c := e.Client()
	loopback := []string{"127.0.0.0/8", "::1/128"}
	wh := func(secret string) *mux.Webhook {
		return &mux.Webhook{Provider: "hmac", Secret: secret, Header: "X-Sig"}
	}
	for _, tc := range []struct {
		name        string
		first, next mux.Bind
		sig         string // X-Sig of the requests
		retried     bool
	}{
		{"same-cidr", mux.Bind{AllowCIDR: loopback}, mux.Bind{AllowCIDR: loopback}, "", true},
		{"same-webhook", mux.Bind{Webhook: wh("s1")}, mux.Bind{Webhook: wh("s1")}, hmacSig("s1", ""), true},
		{"other-cidr", mux.Bind{}, mux.Bind{DenyCIDR: loopback}, "", false},
		{"other-allow", mux.Bind{AllowCIDR: loopback}, mux.Bind{AllowCIDR: []string{"10.0.0.0/8"}}, "", false},
		{"other-secret", mux.Bind{Webhook: wh("s1")}, mux.Bind{Webhook: wh("s2")}, hmacSig("s1", ""), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			host := tc.name + "." + tunneltest.Domain
			rf, _ := joinPool(t, e, hello("alpha"), tc.name, tc.first)
			rn, _ := joinPool(t, e, hello("alpha"), tc.name, tc.next)
			first, next := serveMember(rf, "first", answerUnsent), serveMember(rn, "next", nil)
			const n = 40
			ok := 0
			for range n {
				req, _ := http.NewRequest(http.MethodGet, tunneltest.URL("http", tc.name, "/"), nil)
				if tc.sig != "" {
					req.Header.Set("X-Sig", tc.sig)
				}
				got := ask(t, c, req)
				if got.unsent {
					t.Fatalf("%s reached the visitor: %+v", mux.UnsentHeader, got)
				}
				if got.status == http.StatusOK {
					ok++
				}
			}
			if first.served(host) == 0 {
				t.Fatalf("no request went to the failing member first: the test checks nothing")
			}
			switch {
			case tc.retried && ok != n:
				t.Fatalf("same rules: %d of %d GETs answered, want all (retried on the other member)", ok, n)
			case !tc.retried && next.served(host) != 0:
				t.Fatalf("other rules: %d requests reached the member whose rules were not checked (%d 200s)", next.served(host), ok)
			}
		})
	}
}

// The same with --oauth: a visitor signed in and let in by one member's
// allow list is never sent on to a member whose list does not have her;
// with the same list, she is.
func TestPoolRetryKeepsOAuthRules(t *testing.T) {
	m := startOIDC(t)
	e := oauthEdge(t, m, func(cfg *edge.Config) { cfg.HeartbeatTimeout = time.Minute })
	alice := &mux.OAuth{Provider: "corp", AllowEmails: []string{"alice@example.com"}}
	for _, tc := range []struct {
		name    string
		next    *mux.OAuth
		retried bool
	}{
		{"oauth-same", alice, true},
		{"oauth-other", &mux.OAuth{Provider: "corp", AllowEmails: []string{"bob@example.com"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rf, _ := joinPool(t, e, hello(""), tc.name, mux.Bind{OAuth: alice})
			rn, _ := joinPool(t, e, hello(""), tc.name, mux.Bind{OAuth: tc.next})
			first, next := serveMember(rf, "first", answerUnsent), serveMember(rn, "next", nil)
			c := visitor(t, e, true)
			m.QueueUser(&mockoidc.MockUser{Subject: "a-1", Email: "alice@example.com", EmailVerified: true})
			oauthDo(t, c, "GET", oauthURL(e, tc.name, "/")) // signs in, whichever member it met
			sessionCookie(t, c, oauthURL(e, tc.name, "/"))
			const n = 30
			ok := 0
			for range n {
				a := oauthDo(t, c, "GET", oauthURL(e, tc.name, "/"))
				if _, unsent := a.header[mux.UnsentHeader]; unsent {
					t.Fatalf("%s reached the visitor: %+v", mux.UnsentHeader, a)
				}
				if a.status == http.StatusOK {
					ok++
				}
			}
			if first.total() == 0 {
				t.Fatal("no request went to the failing member first: the test checks nothing")
			}
			switch {
			case tc.retried && ok != n:
				t.Fatalf("same allow list: %d of %d GETs answered, want all", ok, n)
			case !tc.retried && next.total() != 0:
				t.Fatalf("other allow list: %d of alice's requests reached the member that does not let her in", next.total())
			}
		})
	}
}

// A request with a body is never sent twice, whatever the member that
// got it answers: every request reaches one member once.
func TestPoolBodyNeverRetried(t *testing.T) {
	e := rawPoolEdge(t)
	host := "body." + tunneltest.Domain
	ra, _ := joinPool(t, e, hello("alpha"), "body", mux.Bind{})
	rb, _ := joinPool(t, e, hello("alpha"), "body", mux.Bind{})
	a, b := serveMember(ra, "A", answerUnsent), serveMember(rb, "B", nil)
	c := e.Client()
	const n = 60
	oks, bads := 0, 0
	for i := range n {
		var req *http.Request
		switch i % 3 {
		case 0:
			req, _ = http.NewRequest(http.MethodPost, tunneltest.URL("http", "body", "/"), strings.NewReader("payload"))
		case 1: // a GET with a body
			req, _ = http.NewRequest(http.MethodGet, tunneltest.URL("http", "body", "/"), strings.NewReader("x"))
		case 2: // chunked
			req, _ = http.NewRequest(http.MethodPut, tunneltest.URL("http", "body", "/"), io.MultiReader(strings.NewReader("chunk")))
		}
		switch got := ask(t, c, req); {
		case got.status == http.StatusOK && got.body == "B":
			oks++
		case got.status == http.StatusBadGateway && got.code == mux.CodeUpstreamUnreachable && !got.unsent:
			bads++
		default:
			t.Fatalf("%s: %+v", req.Method, got)
		}
	}
	na, nb := a.served(host), b.served(host)
	if na+nb != n || na != bads || nb != oks || na == 0 {
		t.Fatalf("%d requests with a body: A got %d (%d answered 502), B %d (%d answered 200); want each once, A some", n, na, bads, nb, oks)
	}
	if a.bodies+b.bodies != n {
		t.Fatalf("%d requests reached a member with their body, want %d", a.bodies+b.bodies, n)
	}
}

// Members leave, gracefully, while GETs keep coming: not one fails while
// a member is left; then the name is free.
func TestPoolMembersLeaveWhileRouting(t *testing.T) {
	e := tunneltest.StartEdge(t, poolEdgeConfig(t))
	var agents []*tunneltest.Agent
	for i := range 3 {
		m := startMember(t, fmt.Sprintf("m%d", i))
		agents = append(agents, poolAgent(t, e, e.AgentConfig("", m.addr), "leave"))
	}
	c := e.Client()
	var done atomic.Int64
	var failed atomic.Value
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for i := 0; i < 5000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := c.Get(tunneltest.URL("https", "leave", "/"))
				if err != nil {
					failed.CompareAndSwap(nil, err.Error())
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					failed.CompareAndSwap(nil, fmt.Sprintf("%d %s", resp.StatusCode, b))
				}
				done.Add(1)
			}
		})
	}
	for _, a := range agents[:2] {
		at := done.Load()
		tunneltest.Eventually(t, 10*time.Second, "GETs before the leave", func() bool { return done.Load() > at+20 })
		if err := a.Stop(); err != nil {
			t.Fatalf("stop: %v", err)
		}
		at = done.Load()
		tunneltest.Eventually(t, 10*time.Second, "GETs after the leave", func() bool { return done.Load() > at+20 })
	}
	close(stop)
	wg.Wait()
	if f := failed.Load(); f != nil {
		t.Fatalf("a GET failed while members left: %v", f)
	}
	if tn := poolTunnel(t, e, "leave."+tunneltest.Domain); len(tn.Members) != 1 {
		t.Fatalf("pool after two left: %+v", tn)
	}
	agents[2].Stop()
	tunneltest.Eventually(t, 10*time.Second, "the name free", func() bool {
		list, err := e.Tunnels(context.Background())
		return err == nil && len(list) == 0
	})
}

// Members join and leave over and over (bind, unbind) while GETs come:
// every GET is answered, and at the end the pool is its one steady member.
func TestPoolChurn(t *testing.T) {
	e := rawPoolEdge(t)
	host := "churn." + tunneltest.Domain
	rs, ss := joinPool(t, e, hello("alpha"), "churn", mux.Bind{})
	serveMember(rs, "steady", nil)
	c := e.Client()
	stop := make(chan struct{})
	var failed atomic.Value
	var visits sync.WaitGroup
	for range 2 {
		visits.Go(func() {
			for i := 0; i < 5000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := c.Get(tunneltest.URL("http", "churn", "/"))
				if err != nil {
					failed.CompareAndSwap(nil, err.Error())
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					failed.CompareAndSwap(nil, fmt.Sprintf("status %d %s", resp.StatusCode, resp.Header.Get(mux.ErrorHeader)))
				}
			}
		})
	}
	var churn sync.WaitGroup
	for i := range 4 {
		r, m := e.DialRaw(t, hello("alpha"))
		if _, ok := m.(*mux.HelloOK); !ok {
			t.Fatalf("hello: %+v", m)
		}
		serveMember(r, fmt.Sprintf("c%d", i), nil)
		churn.Go(func() {
			for range 25 {
				if err := exchange(r, &mux.Bind{Subdomain: "churn", Pool: true}, func(m mux.Message) bool {
					_, ok := m.(*mux.BindOK)
					return ok
				}); err != nil {
					t.Errorf("churn bind: %v", err)
					return
				}
				if err := exchange(r, &mux.Unbind{Hostname: host}, func(m mux.Message) bool {
					_, ok := m.(*mux.Unbound)
					return ok
				}); err != nil {
					t.Errorf("churn unbind: %v", err)
					return
				}
			}
		})
	}
	churn.Wait()
	close(stop)
	visits.Wait()
	if f := failed.Load(); f != nil {
		t.Fatalf("a GET failed during the churn: %v", f)
	}
	tn := poolTunnel(t, e, host)
	if len(tn.Members) != 1 || tn.Members[0].SessionID != ss {
		t.Fatalf("pool after the churn: %+v, want the steady member alone", tn.Members)
	}
	wantEqual(t, scrape(t, e, ""), "ngstone_pool_members_down", 0)
}

// An edge that restarts on its registry file keeps a pool of two: while
// the members' agents are away no other token gets in, with --pool or
// without, nor the pool's token without --pool; each agent, back, takes
// its own member back at a higher generation, and both serve.
func TestPoolSurvivesEdgeRestart(t *testing.T) {
	cfg := rawPoolConfig(t)
	e1 := tunneltest.StartEdge(t, cfg)
	host := "bp." + tunneltest.Domain
	ha, hb := hello("alpha"), hello("alpha")
	joinPool(t, e1, ha, "bp", mux.Bind{})
	joinPool(t, e1, hb, "bp", mux.Bind{})
	before := poolTunnel(t, e1, host)
	e1.Close()

	e2 := tunneltest.StartEdge(t, cfg)
	c := e2.Client()
	if got := getPool(t, c, "bp"); got.status != http.StatusServiceUnavailable || got.code != mux.CodeTunnelOffline {
		t.Fatalf("GET bp before the members are back: %+v, want 503 tunnel_offline", got)
	}
	for _, tc := range []struct {
		what string
		h    *mux.Hello
		pool bool
	}{
		{"another token with --pool", hello("beta"), true},
		{"another token", hello("beta"), false},
		{"another token with a member's instance id", sameInstance(ha, "beta"), true},
		{"the token without --pool", hello("alpha"), false},
	} {
		r, m := e2.DialRaw(t, tc.h)
		if _, ok := m.(*mux.HelloOK); !ok {
			t.Fatalf("%s: hello %+v", tc.what, m)
		}
		if be, ok := r.Bind(t, &mux.Bind{Subdomain: "bp", Pool: tc.pool, Takeover: true}).(*mux.BindError); !ok || be.Code != mux.CodeSubdomainTaken {
			t.Fatalf("%s after the restart: %+v, want subdomain_taken", tc.what, be)
		}
		r.YS.Close()
	}
	ra, sa := joinPool(t, e2, sameInstance(ha, "alpha"), "bp", mux.Bind{Takeover: true})
	rb, sb := joinPool(t, e2, sameInstance(hb, "alpha"), "bp", mux.Bind{Takeover: true})
	a, b := serveMember(ra, "A", nil), serveMember(rb, "B", nil)
	tn := poolTunnel(t, e2, host)
	if len(tn.Members) != 2 || tn.Members[0].SessionID != sa || tn.Members[1].SessionID != sb {
		t.Fatalf("pool after both came back: %+v, want sessions [%d %d]", tn.Members, sa, sb)
	}
	for i, m := range tn.Members {
		if m.Generation <= before.Members[i].Generation {
			t.Fatalf("member %d came back at generation %d, not above %d", i, m.Generation, before.Members[i].Generation)
		}
	}
	for range 40 {
		if got := getPool(t, c, "bp"); got.status != http.StatusOK {
			t.Fatalf("GET bp: %+v", got)
		}
	}
	if a.served(host) == 0 || b.served(host) == 0 {
		t.Fatalf("A served %d, B %d of 40: both must", a.served(host), b.served(host))
	}
	// Now live, still no other token.
	r, _ := e2.DialRaw(t, hello("beta"))
	if be, ok := r.Bind(t, &mux.Bind{Subdomain: "bp", Pool: true}).(*mux.BindError); !ok || be.Code != mux.CodeSubdomainTaken {
		t.Fatalf("another token after the members came back: %+v", be)
	}
}
