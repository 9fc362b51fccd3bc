package tunneltest

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/mux"
)

// RawSession is a hand-driven agent session for protocol-level tests: the
// yamux module over plain TLS, without ngstone's coalescing connection, so
// that every test with a raw agent also checks that an edge speaks yamux
// to a peer that writes frames as yamux does.
type RawSession struct {
	YS   *yamux.Session
	Ctrl *yamux.Stream
}

// DialRaw opens a control connection, sends hello and returns the session
// with the edge's answer (hello_ok or error).
func (e *Edge) DialRaw(t testing.TB, hello *mux.Hello) (*RawSession, mux.Message) {
	t.Helper()
	return e.DialRawOver(t, hello, nil)
}

// DialRawOver is DialRaw with the session over wrap(the TLS connection),
// for a test that watches or alters what crosses it; a nil wrap is none.
func (e *Edge) DialRawOver(t testing.TB, hello *mux.Hello, wrap func(net.Conn) net.Conn) (*RawSession, mux.Message) {
	t.Helper()
	return DialRawAt(t, e.Addr("control").String(), e.Roots, hello, wrap)
}

// DialRawAt is DialRawOver for the control address of any edge (one of
// another process, say) whose certificate roots verifies.
func DialRawAt(t testing.TB, control string, roots *x509.CertPool, hello *mux.Hello, wrap func(net.Conn) net.Conn) (*RawSession, mux.Message) {
	t.Helper()
	tc, err := tls.Dial("tcp", control, &tls.Config{RootCAs: roots, ServerName: "localhost", NextProtos: []string{mux.ALPN}})
	if err != nil {
		t.Fatal(err)
	}
	var c net.Conn = tc
	if wrap != nil {
		c = wrap(c)
	}
	ys, err := yamux.Client(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ys.Close() })
	ctrl, err := ys.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	r := &RawSession{YS: ys, Ctrl: ctrl}
	if err := mux.Write(ctrl, hello); err != nil {
		t.Fatal(err)
	}
	return r, r.Read(t)
}

// Read reads the next control message, failing the test after 5s.
func (r *RawSession) Read(t testing.TB) mux.Message {
	t.Helper()
	r.Ctrl.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer r.Ctrl.SetReadDeadline(time.Time{})
	m, err := mux.Read(r.Ctrl)
	if err != nil {
		t.Fatalf("read control message: %v", err)
	}
	return m
}

// Bind sends a bind and returns the edge's answer, skipping heartbeat acks.
func (r *RawSession) Bind(t testing.TB, b *mux.Bind) mux.Message {
	t.Helper()
	if err := mux.Write(r.Ctrl, b); err != nil {
		t.Fatal(err)
	}
	for {
		m := r.Read(t)
		switch m.(type) {
		case *mux.BindOK, *mux.BindError:
			return m
		}
	}
}
