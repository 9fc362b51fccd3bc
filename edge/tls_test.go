package edge_test

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestTLSPassthrough: a TLS tunnel's visitors reach the local service's
// own TLS through the edge's HTTPS port, by SNI, and see its certificate;
// the edge's roots do not verify it, an HTTP tunnel of the same edge is
// still terminated by the edge, and the passthrough name has no HTTP.
func TestTLSPassthrough(t *testing.T) {
	const name = "secure." + tunneltest.Domain
	cert, roots := tunneltest.SelfSigned(t, name)
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
		tc.SetDeadline(time.Now().Add(tcpDeadline))
		io.WriteString(tc, "hello from the local service\n")
		echoLines(tc)
	})
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	ac := e.AgentConfig("", local)
	ac.Proto, ac.Subdomain = agent.ProtoTLS, "secure"
	a := tunneltest.StartAgent(t, ac)
	st := a.WaitOnline(t)
	if !strings.HasPrefix(st.Tunnels[0].URL, "tls://"+name+":") {
		t.Fatalf("URL %q, want tls://%s:PORT", st.Tunnels[0].URL, name)
	}
	b := tunneltest.StartBackend(t)
	web := tunneltest.StartAgent(t, func() agent.Config { c := e.AgentConfig("", b.Addr()); c.Subdomain = "web"; return c }())
	web.WaitOnline(t)

	dial := func(trust *x509.CertPool) (*tls.Conn, error) {
		d := &net.Dialer{Timeout: 5 * time.Second}
		return tls.DialWithDialer(d, "tcp", e.Addr("https").String(), &tls.Config{ServerName: name, RootCAs: trust})
	}
	for round := range 3 {
		c, err := dial(roots)
		if err != nil {
			t.Fatalf("round %d: dial through the edge: %v", round, err)
		}
		if got := c.ConnectionState().PeerCertificates[0].Raw; !bytes.Equal(got, cert.Leaf.Raw) {
			t.Fatalf("round %d: the visitor sees another certificate than the local service's", round)
		}
		c.SetDeadline(time.Now().Add(tcpDeadline))
		br := bufio.NewReader(c)
		if line, err := br.ReadString('\n'); err != nil || line != "hello from the local service\n" {
			t.Fatalf("round %d: %q %v", round, line, err)
		}
		io.WriteString(c, "ping\n")
		if line, err := br.ReadString('\n'); err != nil || line != "echo: ping\n" {
			t.Fatalf("round %d: %q %v", round, line, err)
		}
		c.Close()
	}
	if c, err := dial(e.Roots); err == nil {
		c.Close()
		t.Fatal("the edge's roots verified the passed-through connection: the edge terminated it")
	} else if !errors.As(err, new(*tls.CertificateVerificationError)) {
		t.Fatalf("with the edge's roots: %v, want a verification error", err)
	}

	c := e.Client()
	resp, err := c.Get(tunneltest.URL("https", "web", "/hello"))
	if err != nil || resp.StatusCode != http.StatusOK || resp.TLS == nil || !resp.TLS.PeerCertificates[0].Equal(edgeLeaf(t, e)) {
		t.Fatalf("an HTTP tunnel beside it: %v %v", err, resp)
	}
	resp.Body.Close()
	resp, err = c.Get(tunneltest.URL("http", "secure", "/"))
	if err != nil || resp.StatusCode != http.StatusNotFound || resp.Header.Get("Ngstone-Error") != mux.CodeTunnelNotFound {
		t.Fatalf("plain HTTP to the passthrough name: %v %v", err, resp)
	}
	resp.Body.Close()
}

// edgeLeaf is the certificate the edge serves for its domain's names.
func edgeLeaf(t *testing.T, e *tunneltest.Edge) *x509.Certificate {
	t.Helper()
	c, err := tls.Dial("tcp", e.Addr("https").String(), &tls.Config{ServerName: "web." + tunneltest.Domain, RootCAs: e.Roots})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0]
}

// echoLines answers each line read from rw with "echo: " and the line,
// until a read fails.
func echoLines(rw io.ReadWriter) {
	br := bufio.NewReader(rw)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return
		}
		io.WriteString(rw, "echo: "+line)
	}
}
