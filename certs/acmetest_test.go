package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/letsencrypt/pebble/v2/ca"
	"github.com/letsencrypt/pebble/v2/db"
	"github.com/letsencrypt/pebble/v2/va"
	"github.com/letsencrypt/pebble/v2/wfe"
	"github.com/miekg/dns"
)

// testDomain is the edge's domain in the ACME tests; testDNS is
// authoritative for it and resolves every name under it to 127.0.0.1.
const testDomain = "ngstone.test"

// pebbleCA is an in-process pebble ACME server on loopback.
type pebbleCA struct {
	dirURL   string         // the ACME directory
	rootFile string         // PEM of the directory's HTTPS certificate, for Config.ACMECARoot
	roots    *x509.CertPool // pebble's issuing root, for visitors
}

// startPebble runs pebble whose VA validates HTTP-01 on httpPort,
// TLS-ALPN-01 on tlsPort, and resolves names with the DNS server at dnsAddr.
func startPebble(t *testing.T, httpPort, tlsPort int, dnsAddr string) *pebbleCA {
	t.Helper()
	logger := log.New(io.Discard, "", 0)
	if os.Getenv("PEBBLE_TEST_LOG") != "" {
		logger = log.New(testWriter{t}, "pebble ", 0)
	}
	store := db.NewMemoryStore()
	authority := ca.New(logger, store, "", "ecdsa", 0, 1, map[string]ca.Profile{"default": {Description: "default"}})
	validator := va.New(logger, httpPort, tlsPort, false, dnsAddr, store)
	front := wfe.New(logger, store, validator, authority, []string{"pebble.letsencrypt.org"}, false, false, 0, 0)
	srv := httptest.NewUnstartedServer(front.Handler())
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)

	rootFile := filepath.Join(t.TempDir(), "acme-root.pem")
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(rootFile, pemBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(authority.GetRootCert(0).Cert)
	return &pebbleCA{dirURL: srv.URL + wfe.DirectoryPath, rootFile: rootFile, roots: roots}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// testDNS is an authoritative DNS server for testDomain on loopback (UDP
// and TCP on one port). It accepts RFC 2136 updates signed with its TSIG
// key and serves the TXT records they set.
type testDNS struct {
	addr            string
	keyName, secret string

	mu  sync.Mutex
	txt map[string][]string // by lower-case FQDN
}

func startDNS(t *testing.T) *testDNS {
	t.Helper()
	d := &testDNS{keyName: "ngstone-test.", secret: "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0IQ==", txt: map[string][]string{}}
	pc, ln := listenUDPTCP(t)
	d.addr = pc.LocalAddr().String()
	tsig := map[string]string{d.keyName: d.secret}
	for _, srv := range []*dns.Server{
		{PacketConn: pc, Handler: d, TsigSecret: tsig, MsgAcceptFunc: acceptUpdates},
		{Listener: ln, Handler: d, TsigSecret: tsig, MsgAcceptFunc: acceptUpdates},
	} {
		started := make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started) }
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = srv.ActivateAndServe()
		}()
		<-started
		t.Cleanup(func() {
			_ = srv.Shutdown()
			<-done
		})
	}
	return d
}

// acceptUpdates lets UPDATE messages through, which miekg/dns's default
// filter answers with NOTIMP.
func acceptUpdates(dh dns.Header) dns.MsgAcceptAction {
	if int(dh.Bits>>11)&0xF == dns.OpcodeUpdate {
		return dns.MsgAccept
	}
	return dns.DefaultMsgAcceptFunc(dh)
}

// listenUDPTCP binds UDP and TCP on the same free loopback port.
func listenUDPTCP(t *testing.T) (net.PacketConn, net.Listener) {
	for range 20 {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", pc.LocalAddr().String())
		if err == nil {
			return pc, ln
		}
		pc.Close()
	}
	t.Fatal("no loopback port free for both UDP and TCP")
	return nil, nil
}

func (d *testDNS) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	if r.Opcode == dns.OpcodeUpdate {
		d.update(w, r, m)
	} else if len(r.Question) == 1 {
		d.answer(r.Question[0], m)
	}
	if r.IsTsig() != nil && w.TsigStatus() == nil {
		m.SetTsig(d.keyName, dns.HmacSHA256, 300, time.Now().Unix())
	}
	_ = w.WriteMsg(m)
}

func (d *testDNS) update(w dns.ResponseWriter, r, m *dns.Msg) {
	if r.IsTsig() == nil || w.TsigStatus() != nil {
		m.Rcode = dns.RcodeRefused
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, rr := range r.Ns {
		txt, ok := rr.(*dns.TXT)
		if !ok {
			continue
		}
		name := strings.ToLower(txt.Hdr.Name)
		val := strings.Join(txt.Txt, "")
		switch txt.Hdr.Class {
		case dns.ClassINET:
			d.txt[name] = append(d.txt[name], val)
		case dns.ClassNONE:
			d.txt[name] = without(d.txt[name], val)
		}
	}
}

func without(s []string, v string) []string {
	out := s[:0]
	for _, x := range s {
		if x != v {
			out = append(out, x)
		}
	}
	return out
}

func (d *testDNS) answer(q dns.Question, m *dns.Msg) {
	name := strings.ToLower(q.Name)
	zone := testDomain + "."
	if name != zone && !strings.HasSuffix(name, "."+zone) {
		m.Rcode = dns.RcodeNameError
		return
	}
	m.Authoritative = true
	hdr := dns.RR_Header{Name: q.Name, Rrtype: q.Qtype, Class: dns.ClassINET, Ttl: 1}
	switch q.Qtype {
	case dns.TypeSOA:
		if name == zone {
			m.Answer = append(m.Answer, &dns.SOA{Hdr: hdr, Ns: "ns." + zone, Mbox: "hostmaster." + zone, Serial: 1, Refresh: 60, Retry: 60, Expire: 60, Minttl: 1})
		}
	case dns.TypeA:
		m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: net.IPv4(127, 0, 0, 1)})
	case dns.TypeTXT:
		d.mu.Lock()
		for _, v := range d.txt[name] {
			m.Answer = append(m.Answer, &dns.TXT{Hdr: hdr, Txt: []string{v}})
		}
		d.mu.Unlock()
	}
}

// rfc2136Creds are the DNSCredentials that let the rfc2136 provider
// update d.
func (d *testDNS) rfc2136Creds() map[string]string {
	return map[string]string{"server": d.addr, "tsig_key": d.keyName, "tsig_secret": d.secret}
}

// serveTLS runs an HTTPS server on a loopback listener with m's TLS config;
// it answers "hello HOST".
func serveTLS(t *testing.T, ln net.Listener, m *Manager) {
	t.Helper()
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "hello %s", r.Host)
		}),
		TLSConfig:         m.TLSConfig(),
		ErrorLog:          m.ErrorLog(),
		ReadHeaderTimeout: 10 * time.Second,
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.ServeTLS(ln, "", "")
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
}

// serveHTTP runs a plain HTTP server on ln with h.
func serveHTTP(t *testing.T, ln net.Listener, h http.Handler) {
	t.Helper()
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
}

// get fetches https://host/ through addr, trusting roots, and returns the
// body, or the error.
func get(t *testing.T, roots *x509.CertPool, addr, host string) (string, *x509.Certificate, error) {
	t.Helper()
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: host},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
		ForceAttemptHTTP2: true,
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	resp, err := client.Get("https://" + host + "/")
	if err != nil {
		return "", nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), resp.TLS.PeerCertificates[0], err
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

func portOf(ln net.Listener) int { return ln.Addr().(*net.TCPAddr).Port }

func testLogger(t *testing.T) *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// allowOnly is a HostPolicy allowing the given hosts.
func allowOnly(hosts ...string) HostPolicy {
	return func(_ context.Context, host string) error {
		for _, h := range hosts {
			if h == host {
				return nil
			}
		}
		return fmt.Errorf("%s is not bound", host)
	}
}
