package certs

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/caddyserver/certmagic"
	"github.com/libdns/libdns"
	"github.com/miekg/dns"
)

// rfc2136 sets and removes DNS-01 records by dynamic update (RFC 2136),
// signed with TSIG when a key is given: BIND, Knot, PowerDNS and others
// accept it.
type rfc2136 struct {
	server    string // host:port
	keyName   string // FQDN, empty for unsigned updates
	secret    string // base64
	algorithm string // FQDN, e.g. hmac-sha256.
}

func newRFC2136(vals map[string]string) (certmagic.DNSProvider, error) {
	p := &rfc2136{server: vals["server"], secret: vals["tsig_secret"]}
	if _, _, err := net.SplitHostPort(p.server); err != nil {
		p.server = net.JoinHostPort(p.server, "53")
	}
	if k := vals["tsig_key"]; k != "" {
		if p.secret == "" {
			return nil, fmt.Errorf("setting tsig_secret is required with tsig_key")
		}
		p.keyName = dns.Fqdn(k)
		p.algorithm = dns.Fqdn(strings.ToLower(vals["tsig_algorithm"]))
		if vals["tsig_algorithm"] == "" {
			p.algorithm = dns.HmacSHA256
		}
		switch p.algorithm {
		case dns.HmacSHA1, dns.HmacSHA224, dns.HmacSHA256, dns.HmacSHA384, dns.HmacSHA512:
		default:
			return nil, fmt.Errorf("setting tsig_algorithm %q: not one of hmac-sha1, hmac-sha224, hmac-sha256, hmac-sha384, hmac-sha512", vals["tsig_algorithm"])
		}
	}
	return p, nil
}

// AppendRecords adds recs to zone.
func (p *rfc2136) AppendRecords(ctx context.Context, zone string, recs []libdns.Record) ([]libdns.Record, error) {
	return p.update(ctx, zone, recs, (*dns.Msg).Insert)
}

// DeleteRecords removes recs (matched by name, type and value) from zone.
func (p *rfc2136) DeleteRecords(ctx context.Context, zone string, recs []libdns.Record) ([]libdns.Record, error) {
	return p.update(ctx, zone, recs, (*dns.Msg).Remove)
}

func (p *rfc2136) update(ctx context.Context, zone string, recs []libdns.Record, op func(*dns.Msg, []dns.RR)) ([]libdns.Record, error) {
	zone = dns.Fqdn(zone)
	rrs := make([]dns.RR, 0, len(recs))
	for _, r := range recs {
		rr, err := toDNSRR(r.RR(), zone)
		if err != nil {
			return nil, err
		}
		rrs = append(rrs, rr)
	}
	m := new(dns.Msg)
	m.SetUpdate(zone)
	op(m, rrs)
	c := &dns.Client{Net: "tcp", Timeout: 10 * time.Second}
	if p.keyName != "" {
		m.SetTsig(p.keyName, p.algorithm, 300, time.Now().Unix())
		c.TsigSecret = map[string]string{p.keyName: p.secret}
	}
	in, _, err := c.ExchangeContext(ctx, m, p.server)
	if err != nil {
		return nil, fmt.Errorf("rfc2136 update of zone %s at %s: %w", zone, p.server, err)
	}
	if in.Rcode != dns.RcodeSuccess {
		return nil, fmt.Errorf("rfc2136 update of zone %s at %s: server answered %s", zone, p.server, dns.RcodeToString[in.Rcode])
	}
	return recs, nil
}

func toDNSRR(r libdns.RR, zone string) (dns.RR, error) {
	ttl := uint32(r.TTL / time.Second)
	if ttl == 0 {
		ttl = 60
	}
	name := libdns.AbsoluteName(r.Name, zone)
	rr, err := dns.NewRR(fmt.Sprintf("%s %d IN %s %s", name, ttl, r.Type, quoteTXT(r)))
	if err != nil {
		return nil, fmt.Errorf("record %s %s: %w", r.Name, r.Type, err)
	}
	return rr, nil
}

func quoteTXT(r libdns.RR) string {
	if r.Type != "TXT" {
		return r.Data
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(r.Data) + `"`
}
