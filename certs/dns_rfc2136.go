package certs

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"strconv"
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
	if _, port, err := net.SplitHostPort(p.server); err != nil || vals["server"] == "" {
		return nil, fmt.Errorf("setting server %q: want HOST or HOST:PORT", vals["server"])
	} else if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
		return nil, fmt.Errorf("setting server %q: port %q is not a number from 1 to 65535", vals["server"], port)
	}
	k := vals["tsig_key"]
	switch {
	case k == "" && p.secret != "":
		return nil, fmt.Errorf("setting tsig_key is required with tsig_secret")
	case k == "":
		return p, nil
	case p.secret == "":
		return nil, fmt.Errorf("setting tsig_secret is required with tsig_key")
	}
	if _, err := base64.StdEncoding.DecodeString(p.secret); err != nil {
		return nil, fmt.Errorf("setting tsig_secret of key %s: not base64 (as tsig-keygen prints it): %w", k, err)
	}
	p.keyName = dns.Fqdn(strings.ToLower(k))
	p.algorithm = dns.Fqdn(strings.ToLower(vals["tsig_algorithm"]))
	if vals["tsig_algorithm"] == "" {
		p.algorithm = dns.HmacSHA256
	}
	switch p.algorithm {
	case dns.HmacSHA1, dns.HmacSHA224, dns.HmacSHA256, dns.HmacSHA384, dns.HmacSHA512:
	default:
		return nil, fmt.Errorf("setting tsig_algorithm %q: not one of hmac-sha1, hmac-sha224, hmac-sha256, hmac-sha384, hmac-sha512", vals["tsig_algorithm"])
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
	in, err := p.exchange(ctx, m)
	if err = p.answerError(in, err); err != nil {
		return nil, fmt.Errorf("rfc2136 update of zone %s at %s: %w", zone, p.server, err)
	}
	return recs, nil
}

// check asks the server, signed as an update would be, for the SOA of
// fqdn's zone: it proves the server answers, knows the key and is
// authoritative, without changing anything.
func (p *rfc2136) check(ctx context.Context, fqdn string) error {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(fqdn), dns.TypeSOA)
	m.RecursionDesired = false
	in, err := p.exchange(ctx, m)
	if err = p.answerError(in, err); err != nil && !(in != nil && in.Rcode == dns.RcodeNameError) {
		return fmt.Errorf("rfc2136 check of %s at %s: %w", fqdn, p.server, err)
	}
	for _, rr := range append(in.Answer, in.Ns...) {
		if _, ok := rr.(*dns.SOA); ok && in.Authoritative {
			return nil
		}
	}
	return fmt.Errorf("rfc2136 check of %s at %s: %w: the server is not authoritative for its zone (no SOA in an authoritative answer); point setting server at the zone's primary", fqdn, p.server, ErrDNSUpdate)
}

func (p *rfc2136) exchange(ctx context.Context, m *dns.Msg) (*dns.Msg, error) {
	c := &dns.Client{Net: "tcp", Timeout: 10 * time.Second}
	if p.keyName != "" {
		m.SetTsig(p.keyName, p.algorithm, 300, time.Now().Unix())
		c.TsigSecret = map[string]string{p.keyName: p.secret}
	}
	in, _, err := c.ExchangeContext(ctx, m, p.server)
	return in, err
}

// answerError turns what the server answered into an error that names the
// setting to look at: miekg/dns reports every refused signature as "bad
// authentication", whether the key name, its algorithm or its secret is
// wrong, but the server's TSIG record says which.
func (p *rfc2136) answerError(in *dns.Msg, err error) error {
	if in == nil {
		if err == nil {
			err = errors.New("no answer")
		}
		return fmt.Errorf("%w: %w (is the server running, and is setting server's port right?)", ErrDNSUnreachable, err)
	}
	if t := in.IsTsig(); t != nil && t.Error != dns.RcodeSuccess {
		return p.tsigError(t.Error)
	}
	if in.Rcode == dns.RcodeNotAuth || in.Rcode == dns.RcodeRefused {
		return fmt.Errorf("%w: server answered %s: %s", ErrDNSAuth, dns.RcodeToString[in.Rcode], p.refusedHint())
	}
	if err != nil {
		return fmt.Errorf("%w: the server's answer did not verify with %s: %w", ErrDNSAuth, p.keyDesc(), err)
	}
	if in.Rcode != dns.RcodeSuccess {
		return fmt.Errorf("%w: server answered %s", ErrDNSUpdate, dns.RcodeToString[in.Rcode])
	}
	return nil
}

func (p *rfc2136) tsigError(code uint16) error {
	switch code {
	case dns.RcodeBadKey:
		return fmt.Errorf("%w: server answered BADKEY: it has no key named %s with algorithm %s; check settings tsig_key and tsig_algorithm against the server's key statement", ErrDNSAuth, p.keyName, p.algorithm)
	case dns.RcodeBadSig:
		return fmt.Errorf("%w: server answered BADSIG: it knows key %s (%s) but the signature does not verify; check setting tsig_secret", ErrDNSAuth, p.keyName, p.algorithm)
	case dns.RcodeBadTime:
		return fmt.Errorf("%w: server answered BADTIME: this machine's clock and the server's differ by more than 300s", ErrDNSAuth)
	}
	return fmt.Errorf("%w: server answered TSIG error %s for key %s", ErrDNSAuth, dns.RcodeToString[int(code)], p.keyName)
}

func (p *rfc2136) refusedHint() string {
	if p.keyName == "" {
		return "unsigned updates are refused; set tsig_key and tsig_secret, or allow updates for this zone on the server"
	}
	return fmt.Sprintf("key %s may not update this zone, or the server is not its primary (check the zone's update-policy or allow-update)", p.keyName)
}

func (p *rfc2136) keyDesc() string {
	if p.keyName == "" {
		return "no key"
	}
	return fmt.Sprintf("key %s (%s)", p.keyName, p.algorithm)
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
