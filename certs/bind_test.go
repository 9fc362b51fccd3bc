package certs

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/libdns/libdns"

	"github.com/ngstone/ngstone/internal/acmetest"
)

// These tests run against BIND 9 (named, started by the test): the RFC 2136
// server operators run. They skip when named is not installed.

// TestBINDWildcard: the wildcard and DOMAIN obtained through TSIG-signed
// updates to BIND, which pebble's VA then queries, with certmagic's own
// propagation check asking BIND too; the challenge TXT records are gone
// from the zone afterwards.
func TestBINDWildcard(t *testing.T) {
	t.Parallel()
	b := acmetest.StartBIND(t, testDomain)
	p := acmetest.StartCA(t, acmetest.CAConfig{DNS: b.Addr})
	cfg := Config{
		Mode: ModeCertmagic, Domain: testDomain, DataDir: t.TempDir(),
		ACMECA: p.DirectoryURL, ACMECARoot: p.RootFile, ACMEEmail: "ops@" + testDomain,
		DNSProvider: DNSRFC2136, DNSCredentials: b.RFC2136Credentials(), DNSResolvers: []string{b.Addr},
	}
	_, ln := serveReady(t, cfg, nil)
	for _, host := range []string{"app." + testDomain, testDomain} {
		if _, leaf, err := get(t, p.Roots, ln.Addr().String(), host); err != nil {
			t.Fatalf("GET https://%s/: %v", host, err)
		} else if err := leaf.VerifyHostname(host); err != nil {
			t.Error(err)
		}
	}
	name := "_acme-challenge." + testDomain
	deadline := time.Now().Add(30 * time.Second)
	for {
		txt, err := b.TXT(name)
		if err == nil && len(txt) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("TXT %s still in the zone after issuance: %v %v", name, txt, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := p.Orders(); n != 2 {
		t.Errorf("orders placed = %d, want 2 (one per name)", n)
	}
}

// TestBINDErrorsNameTheCause: each way the RFC 2136 settings can be wrong
// is reported, before any order, with the setting to look at, not as
// miekg/dns's "bad authentication" for all of them.
func TestBINDErrorsNameTheCause(t *testing.T) {
	t.Parallel()
	b := acmetest.StartBIND(t, testDomain)
	good := b.RFC2136Credentials()
	with := func(k, v string) map[string]string {
		c := map[string]string{}
		for key, val := range good {
			c[key] = val
		}
		c[k] = v
		return c
	}
	tests := map[string]struct {
		creds   map[string]string
		is      error
		mention []string
		// queryOK: a query is answered (only the update is refused)
		queryOK bool
	}{
		"wrong secret":    {creds: with("tsig_secret", "d3Jvbmctc2VjcmV0LXdyb25nLXNlY3JldC13cm9uZyE="), is: ErrDNSAuth, mention: []string{"BADSIG", "tsig_secret", b.KeyName, b.Addr}},
		"wrong key name":  {creds: with("tsig_key", "other-key"), is: ErrDNSAuth, mention: []string{"BADKEY", "other-key.", "tsig_key", "tsig_algorithm"}},
		"wrong algorithm": {creds: with("tsig_algorithm", "hmac-sha512"), is: ErrDNSAuth, mention: []string{"BADKEY", "hmac-sha512", "tsig_algorithm"}},
		"no key":          {creds: map[string]string{"server": b.Addr}, is: ErrDNSAuth, mention: []string{"REFUSED", "unsigned updates are refused"}, queryOK: true},
		"nothing there":   {creds: with("server", "127.0.0.1:1"), is: ErrDNSUnreachable, mention: []string{"127.0.0.1:1", "connection refused", "is the server running"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			dp, err := newRFC2136(tt.creds)
			if err != nil {
				t.Fatal(err)
			}
			p := dp.(*rfc2136)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			steps := map[string]error{
				"update": func() error { _, err := p.AppendRecords(ctx, testDomain+".", testRecords()); return err }(),
			}
			if err := p.check(ctx, "_acme-challenge."+testDomain); !tt.queryOK {
				steps["check"] = err
			} else if err != nil {
				t.Errorf("check: %v", err)
			}
			for step, err := range steps {
				if err == nil {
					t.Fatalf("%s succeeded", step)
				}
				if !errors.Is(err, tt.is) {
					t.Errorf("%s: %v, want %v", step, err, tt.is)
				}
				for _, w := range tt.mention {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: %q does not mention %q", step, err, w)
					}
				}
				if strings.Contains(err.Error(), "bad authentication") {
					t.Errorf("%s: %q still says only \"bad authentication\"", step, err)
				}
			}
		})
	}
	dp, _ := newRFC2136(good)
	if err := dp.(*rfc2136).check(context.Background(), "_acme-challenge."+testDomain); err != nil {
		t.Errorf("check with the right key: %v", err)
	}
}

func testRecords() []libdns.Record {
	return []libdns.Record{libdns.TXT{Name: "_acme-challenge", Text: "x", TTL: time.Minute}}
}
