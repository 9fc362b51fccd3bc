package agent_test

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// connDeadline bounds each read and write of these tests and each wait on
// the inspector, so that a broken relay fails with a message instead of
// hanging the test.
const connDeadline = 10 * time.Second

// connService is a TCP tunnel's local service: it reads up bytes, answers
// down bytes, then waits for the visitor to close when the first byte it
// read is 'w', and closes at once otherwise. accepted counts its
// connections.
func connService(t *testing.T, up, down int, accepted *atomic.Int64) string {
	t.Helper()
	return tunneltest.ServeConns(t, func(c net.Conn) {
		accepted.Add(1)
		c.SetDeadline(time.Now().Add(connDeadline))
		b := make([]byte, up)
		if _, err := io.ReadFull(c, b); err != nil {
			return
		}
		if _, err := io.Copy(c, tunneltest.Pattern(int64(down))); err != nil {
			return
		}
		if b[0] == 'w' {
			io.Copy(io.Discard, c)
		}
	})
}

// tcpTunnel starts an edge with one TCP port and an agent of a TCP tunnel
// to local, both as the CLI runs them, the inspector on; it returns the
// edge and the agent's status once online.
func tcpTunnel(t *testing.T, local string) (*tunneltest.Edge, agent.Status) {
	t.Helper()
	cfg := tunneltest.EdgeConfig(t)
	cfg.TCPPorts = tunneltest.FreePorts(t, 1)
	e := tunneltest.StartEdge(t, cfg)
	st := tunneltest.StartAgent(t, e.TCPAgentConfig(local, 0)).WaitOnline(t)
	return e, st
}

// visit connects to the TCP tunnel of st through e, sends up bytes (the
// first one first) and reads down bytes back.
func visit(t *testing.T, e *tunneltest.Edge, st agent.Status, first byte, up, down int) net.Conn {
	t.Helper()
	return visitPort(t, e, tcpPortOf(t, st.Tunnels[0]), first, up, down)
}

// tcpPortOf is a TCP tunnel's public port.
func tcpPortOf(t *testing.T, ts agent.TunnelStatus) int {
	t.Helper()
	p, ok := mux.ParseTCPKey(ts.Hostname)
	if !ok {
		t.Fatalf("tunnel %q is not a TCP port", ts.Hostname)
	}
	return p
}

// visitPort is visit to e's public TCP port p.
func visitPort(t *testing.T, e *tunneltest.Edge, p int, first byte, up, down int) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", e.TCPAddr(p).String(), connDeadline)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(connDeadline))
	b := bytes.Repeat([]byte{'x'}, up)
	b[0] = first
	if _, err := c.Write(b); err != nil {
		t.Fatalf("send %d bytes: %v", up, err)
	}
	if n, err := io.ReadFull(c, make([]byte, down)); err != nil {
		t.Fatalf("read %d bytes back: got %d, %v", down, n, err)
	}
	return c
}

// connEntry waits until the inspector's JSON at base lists the entry for
// the connection from visitor and ok holds for it, or fails the test.
func connEntry(t *testing.T, base, visitor, what string, ok func(agent.Capture) bool) agent.Capture {
	t.Helper()
	var last []agent.Capture
	deadline := time.Now().Add(connDeadline)
	for {
		last = tunneltest.Captures(t, base)
		for _, c := range last {
			if c.Conn != nil && c.Conn.Visitor == visitor && ok(c) {
				return c
			}
		}
		if time.Now().After(deadline) {
			b, _ := json.Marshal(last)
			t.Fatalf("the inspector shows no connection from %s %s in %s: %s", visitor, what, connDeadline, b)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestInspectorConnTCP: a TCP tunnel's connections are listed
// by the inspector from when they open, with the tunnel, its public URL,
// the visitor's address and the bytes each way counted while open; once
// closed, with how they ended (closed by the visitor, by the local
// service, the local service unreachable). None can be replayed, and a
// refused replay reaches nothing.
func TestInspectorConnTCP(t *testing.T) {
	const up, down = 70_000, 130_000
	var accepted atomic.Int64
	e, st := tcpTunnel(t, connService(t, up, down, &accepted))
	base := st.InspectURL

	c := visit(t, e, st, 'w', up, down)
	from := c.LocalAddr().String()
	open := connEntry(t, base, from, "open with its bytes counted", func(c agent.Capture) bool {
		return c.Conn.Open && c.Conn.BytesIn == up && c.Conn.BytesOut == down
	})
	if open.Method != "TCP" || open.Tunnel != "command_line" || open.Conn.Proto != "tcp" || open.Conn.PublicURL != st.Tunnels[0].URL ||
		open.Conn.End != "" || open.Status != 0 || open.Request.Head != "" || open.Response.Body != nil {
		t.Errorf("open connection: %+v %+v, want TCP of command_line at %s, no head or body", open, *open.Conn, st.Tunnels[0].URL)
	}
	c.Close()
	closed := connEntry(t, base, from, "closed", func(c agent.Capture) bool { return !c.Conn.Open })
	if closed.ID != open.ID || closed.Conn.End != "visitor_closed" || closed.Conn.BytesIn != up || closed.Conn.BytesOut != down || closed.Duration <= 0 {
		t.Errorf("closed by the visitor: %+v %+v, want entry %d visitor_closed, %d bytes in, %d out", closed, *closed.Conn, open.ID, up, down)
	}

	// The local service closes first.
	c = visit(t, e, st, 'c', up, down)
	first := connEntry(t, base, c.LocalAddr().String(), "closed", func(c agent.Capture) bool { return !c.Conn.Open })
	if first.Conn.End != "local_closed" || first.Conn.BytesIn != up || first.Conn.BytesOut != down {
		t.Errorf("closed by the local service: %+v", *first.Conn)
	}

	n := accepted.Load()
	for _, id := range []uint64{open.ID, first.ID} {
		resp, err := http.Post(base+"/api/requests/"+strconv.FormatUint(id, 10)+"/replay", "", nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusConflict || !strings.Contains(string(b), "connection cannot be replayed") {
			t.Errorf("replay of connection %d: %d %s, want 409 saying a connection cannot be replayed", id, resp.StatusCode, b)
		}
	}
	if got := accepted.Load(); got != n {
		t.Errorf("the local service got %d connections from refused replays", got-n)
	}
}

// TestInspectorConnUnreachable: a connection the local service
// refuses is listed closed, as local_unreachable, nothing counted.
func TestInspectorConnUnreachable(t *testing.T) {
	// A port below the ephemeral range nothing listens on.
	dead := net.JoinHostPort("127.0.0.1", strconv.Itoa(tunneltest.FreePorts(t, 1)[0].Lo))
	e, st := tcpTunnel(t, dead)
	c, err := net.DialTimeout("tcp", e.TCPAddr(tcpPortOf(t, st.Tunnels[0])).String(), connDeadline)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(connDeadline))
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Fatalf("a visitor of an unreachable local service read %d bytes, %v; want its connection closed", n, err)
	}
	got := connEntry(t, st.InspectURL, c.LocalAddr().String(), "closed", func(c agent.Capture) bool { return !c.Conn.Open })
	if got.Conn.End != "local_unreachable" || got.Conn.BytesIn != 0 || got.Conn.BytesOut != 0 {
		t.Errorf("unreachable local service: %+v", *got.Conn)
	}
}

// TestInspectorConnTLS: a TLS passthrough tunnel's connection
// is listed as TLS, at its tls:// URL, the handshake and what it carried
// counted each way.
func TestInspectorConnTLS(t *testing.T) {
	const name = "secure." + tunneltest.Domain
	cert, roots := tunneltest.SelfSigned(t, name)
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
		tc.SetDeadline(time.Now().Add(connDeadline))
		io.Copy(tc, tc) // echo
	})
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	ac := e.AgentConfig("", local)
	ac.Proto, ac.Subdomain = agent.ProtoTLS, "secure"
	st := tunneltest.StartAgent(t, ac).WaitOnline(t)

	raw, err := net.DialTimeout("tcp", e.Addr("https").String(), connDeadline)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(connDeadline))
	c := tls.Client(raw, &tls.Config{ServerName: name, RootCAs: roots})
	msg := strings.Repeat("ping ", 1000)
	io.WriteString(c, msg)
	if _, err := io.ReadFull(c, make([]byte, len(msg))); err != nil {
		t.Fatal(err)
	}
	from := c.LocalAddr().String()
	open := connEntry(t, st.InspectURL, from, "open", func(c agent.Capture) bool {
		return c.Conn.Open && c.Conn.BytesIn > int64(len(msg)) && c.Conn.BytesOut > int64(len(msg))
	})
	if open.Method != "TLS" || open.Conn.Proto != "tls" || open.Conn.PublicURL != st.Tunnels[0].URL || !strings.HasPrefix(open.Conn.PublicURL, "tls://"+name) {
		t.Errorf("TLS connection: %+v %+v", open, *open.Conn)
	}
	// Closed under TLS, with no close_notify: the local service would
	// close first on one, since the relay sees bytes, not TLS.
	raw.Close()
	connEntry(t, st.InspectURL, from, "closed by the visitor", func(c agent.Capture) bool { return !c.Conn.Open && c.Conn.End == "visitor_closed" })
}

// TestInspectorConnBounded: connections take places in the
// inspector's list as exchanges do: past its capacity the oldest go, one
// still open too.
func TestInspectorConnBounded(t *testing.T) {
	const up, down = 10, 20
	var accepted atomic.Int64
	e, st := tcpTunnel(t, connService(t, up, down, &accepted))
	held := visit(t, e, st, 'w', up, down)
	connEntry(t, st.InspectURL, held.LocalAddr().String(), "open", func(c agent.Capture) bool { return c.Conn.Open })

	for range agent.InspectKeep + 5 {
		c := visit(t, e, st, 'c', up, down)
		c.Close()
	}
	list := tunneltest.Captures(t, st.InspectURL)
	if len(list) != agent.InspectKeep {
		t.Fatalf("the inspector lists %d entries after %d connections, want %d", len(list), agent.InspectKeep+6, agent.InspectKeep)
	}
	for _, c := range list {
		if c.Conn == nil || c.Conn.Visitor == held.LocalAddr().String() {
			t.Fatalf("listed past its capacity: %+v", c)
		}
	}
}

// TestInspectorConnInBrowser: in a real headless Chromium, the page lists
// a TCP tunnel's connections among an HTTP tunnel's exchanges and apart
// from them (marked TCP, with the visitor, the public URL, the bytes each
// way and their state), opens one with no Replay or Edit button, and
// shows it closed once it closes. A screenshot is kept
// (tunneltest.ArtifactDir).
func TestInspectorConnInBrowser(t *testing.T) {
	chromium := tunneltest.Tool(t, "chromium")
	const up, down = 3000, 5000
	var accepted atomic.Int64
	ecfg := tunneltest.EdgeConfig(t)
	ecfg.TCPPorts = tunneltest.FreePorts(t, 1)
	e := tunneltest.StartEdge(t, ecfg)
	cfg := e.AgentConfig("", "")
	web, db := cfg.Tunnel, cfg.Tunnel
	web.Name, web.Subdomain, web.Local = "web", "web", tunneltest.StartBackend(t).Addr()
	db.Name, db.Proto, db.Local = "db", agent.ProtoTCP, connService(t, up, down, &accepted)
	cfg.Tunnel, cfg.Tunnels = agent.Tunnel{}, []agent.Tunnel{web, db}
	st := tunneltest.StartAgent(t, cfg).WaitStatus(t, 10*time.Second, "both tunnels online", func(s agent.Status) bool {
		return len(s.Tunnels) == 2 && s.Tunnels[0].State == agent.TunnelOnline && s.Tunnels[1].State == agent.TunnelOnline
	})
	if code, _ := body(t, e.Client(), tunneltest.URL("https", "web", "/hello")); code != 200 {
		t.Fatalf("GET /hello: %d", code)
	}
	port, dbURL := tcpPortOf(t, st.Tunnels[1]), st.Tunnels[1].URL
	held := visitPort(t, e, port, 'w', up, down)
	from := held.LocalAddr().String()
	open := connEntry(t, st.InspectURL, from, "open", func(c agent.Capture) bool { return c.Conn.Open && c.Conn.BytesOut == down })
	c := visitPort(t, e, port, 'c', up, down)
	gone := connEntry(t, st.InspectURL, c.LocalAddr().String(), "closed", func(c agent.Capture) bool { return !c.Conn.Open })

	ctx := tunneltest.Browser(t, chromium)
	eval := func(js string) []string {
		t.Helper()
		v, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](js))
		if err != nil {
			t.Fatalf("%s: %v", js, err)
		}
		return v
	}
	cells := func(id uint64) []string {
		return eval(fmt.Sprintf(`Array.from(document.querySelectorAll('#rows tr.conn[data-id="%d"] td')).map(td => td.textContent)`, id))
	}
	// waitFor polls the page until ok holds for what js gives.
	waitFor := func(what, js string, ok func([]string) bool) []string {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			v := eval(js)
			if ok(v) {
				return v
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %q", what, v)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if err := chromedp.Do(ctx, chromedp.Navigate(st.InspectURL), chromedp.WaitVisible(chromedp.ID("rows"))); err != nil {
		t.Fatalf("load the page: %v", err)
	}
	waitFor("two connection rows and the request's", `Array.from(document.querySelectorAll("#rows tr")).map(tr => tr.className + " " + tr.children[1].textContent)`,
		func(v []string) bool {
			return len(v) == 3 && v[0] == "row conn ⇄ TCP" && v[1] == "row conn ⇄ TCP" && v[2] == "row GET"
		})

	row := cells(open.ID)
	if len(row) != 6 || row[1] != "⇄ TCP" || row[2] != "db: "+from || row[3] != "open" || row[5] != "↑2.9 KiB\n↓4.9 KiB" {
		t.Errorf("open connection's row (time, kind, tunnel: visitor, state, duration, bytes): %q", row)
	}
	if row := cells(gone.ID); len(row) != 6 || row[3] != "closed by local service" {
		t.Errorf("closed connection's row: %q", row)
	}

	sel := fmt.Sprintf(`#rows tr[data-id="%d"]`, open.ID)
	if err := chromedp.Do(ctx, chromedp.Click(chromedp.CSS(sel)), chromedp.WaitVisible(chromedp.CSS("#detail table.conn"))); err != nil {
		t.Fatalf("open the connection: %v", err)
	}
	detail := eval(`[document.querySelector("#detail h2").textContent, document.querySelector("#detail table.conn").textContent,
		String(document.querySelectorAll("#detail button").length)]`)
	if detail[0] != "TCP connection from "+from+" · open" || !strings.Contains(detail[1], "Public URL"+dbURL) ||
		!strings.Contains(detail[1], "3000 bytes") || !strings.Contains(detail[1], "5000 bytes") || detail[2] != "0" {
		t.Errorf("connection's detail (title, table, buttons): %q", detail)
	}

	held.Close()
	waitFor("the closed connection's row and detail", fmt.Sprintf(`[document.querySelector('#rows tr[data-id="%d"] td:nth-child(4)').textContent,
		document.querySelector("#detail h2").textContent]`, open.ID),
		func(v []string) bool {
			return v[0] == "closed by visitor" && strings.HasSuffix(v[1], "· closed by visitor")
		})

	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(tunneltest.ArtifactDir(t), "inspector-conn.png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(png))
}
