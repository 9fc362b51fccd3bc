package agent_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/mux"
)

// TestBindsFollowHello plays an edge that reads what the agent sends
// before it answers the hello. An agent whose tunnels need no feature
// sends its binds at once, a round trip sooner; one with --hostname waits
// for hello_ok's features, so an older edge (none here) is refused before
// it could bind another name, and no bind ever reaches it.
func TestBindsFollowHello(t *testing.T) {
	for _, tc := range []struct {
		name     string
		hostname string
	}{{"subdomain", ""}, {"hostname", "app.example.net"}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := agent.DefaultConfig()
			cfg.Subdomain = "app"
			if tc.hostname != "" {
				cfg.Subdomain, cfg.Hostname = "", tc.hostname
			}
			a, e := playEdge(t, cfg)
			ctrl := e.ctrl
			ctrl.SetDeadline(time.Now().Add(20 * time.Second))
			if m, err := mux.Read(ctrl); err != nil {
				t.Fatal(err)
			} else if _, ok := m.(*mux.Hello); !ok {
				t.Fatalf("first message %s, want hello", m.MessageType())
			}
			if tc.hostname != "" {
				mux.Write(ctrl, &mux.HelloOK{SessionID: 1}) // an edge without features
				if m, err := mux.Read(ctrl); err == nil {
					t.Fatalf("the agent sent %s to an edge that cannot bind its hostname", m.MessageType())
				}
				<-a.Done()
				var re *agent.RefusedError
				if !errors.As(a.Err(), &re) || re.Code != "unsupported" {
					t.Fatalf("agent ended with %v, want unsupported", a.Err())
				}
				return
			}
			m, err := mux.Read(ctrl) // before hello_ok
			if err != nil {
				t.Fatal(err)
			}
			b, ok := m.(*mux.Bind)
			if !ok || b.Subdomain != "app" {
				t.Fatalf("second message %+v, want the bind of app", m)
			}
			mux.Write(ctrl, &mux.HelloOK{SessionID: 1, Features: []string{mux.FeatureHostname, mux.FeatureVisitorCIDR}})
			mux.Write(ctrl, &mux.BindOK{Hostname: "app.example.net", URL: "https://app.example.net", Generation: 1})
			a.WaitOnline(t)
		})
	}
}

// selfSigned is a TLS server configuration with a fresh self-signed
// certificate and the agent's ALPN.
func selfSigned(t *testing.T) *tls.Config {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, NextProtos: []string{mux.ALPN}}
}

// TestBindSendsMappedPrefixesUnmapped: prefixes in IPv4-mapped form go to
// the edge as the IPv4 prefixes they mean, so that an edge that matches
// them as written (which matched no visitor: a deny list let everyone in)
// applies them all the same.
func TestBindSendsMappedPrefixesUnmapped(t *testing.T) {
	cfg := agent.DefaultConfig()
	cfg.Subdomain = "app"
	cfg.AllowCIDR = []string{"::ffff:10.0.0.0/104", "2001:db8::/32"}
	cfg.DenyCIDR = []string{"::ffff:10.9.9.9/128"}
	_, e := playEdge(t, cfg)
	ctrl := e.ctrl
	ctrl.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := mux.Read(ctrl); err != nil {
		t.Fatal(err)
	}
	mux.Write(ctrl, &mux.HelloOK{SessionID: 1, Features: []string{mux.FeatureVisitorCIDR}})
	m, err := mux.Read(ctrl)
	if err != nil {
		t.Fatal(err)
	}
	b, ok := m.(*mux.Bind)
	if !ok || !slices.Equal(b.AllowCIDR, []string{"10.0.0.0/8", "2001:db8::/32"}) || !slices.Equal(b.DenyCIDR, []string{"10.9.9.9/32"}) {
		t.Fatalf("bind %+v, want allow 10.0.0.0/8 and 2001:db8::/32, deny 10.9.9.9/32", m)
	}
}
