package acmetest

import (
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// DNS is a DNS server authoritative for one zone or more, on loopback (UDP
// and TCP on one port). Every name in them resolves to 127.0.0.1; TXT
// records are those set by RFC 2136 updates signed with its TSIG key (what
// certs' rfc2136 provider sends) or by AddTXT.
type DNS struct {
	// Addr is the server's HOST:PORT, for resolvers and providers.
	Addr string
	// Zone is the first lower-case zone, without trailing dot.
	Zone  string
	zones []string

	mu  sync.Mutex
	txt map[string][]string // by lower-case FQDN
}

// The TSIG key the server accepts updates under.
const (
	tsigKeyName = "ngstone-test."
	tsigSecret  = "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0IQ==" // base64
)

// StartDNS serves zone, and the others (the zones of agents' own
// hostnames, as their CNAMEs would make them), until the end of the test.
func StartDNS(t testing.TB, zone string, others ...string) *DNS {
	t.Helper()
	d := &DNS{txt: map[string][]string{}}
	for _, z := range append([]string{zone}, others...) {
		d.zones = append(d.zones, strings.ToLower(strings.TrimSuffix(z, ".")))
	}
	d.Zone = d.zones[0]
	pc, ln := listenUDPTCP(t)
	d.Addr = pc.LocalAddr().String()
	tsig := map[string]string{tsigKeyName: tsigSecret}
	serve(t, &dns.Server{PacketConn: pc, Handler: d, TsigSecret: tsig, MsgAcceptFunc: acceptUpdates})
	serve(t, &dns.Server{Listener: ln, Handler: d, TsigSecret: tsig, MsgAcceptFunc: acceptUpdates})
	return d
}

// RFC2136Credentials are the certs.Config.DNSCredentials with which the
// rfc2136 provider updates d.
func (d *DNS) RFC2136Credentials() map[string]string {
	return map[string]string{"server": d.Addr, "tsig_key": tsigKeyName, "tsig_secret": tsigSecret}
}

// AddTXT adds a TXT record, for fakes of other providers' APIs.
func (d *DNS) AddTXT(name, value string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	name = strings.ToLower(dns.Fqdn(name))
	d.txt[name] = append(d.txt[name], value)
}

// RemoveTXT removes a TXT record AddTXT or an update added.
func (d *DNS) RemoveTXT(name, value string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	name = strings.ToLower(dns.Fqdn(name))
	d.txt[name] = without(d.txt[name], value)
}

func serve(t testing.TB, srv *dns.Server) {
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

// acceptUpdates lets UPDATE messages through, which miekg/dns's default
// filter answers with NOTIMP.
func acceptUpdates(dh dns.Header) dns.MsgAcceptAction {
	if int(dh.Bits>>11)&0xF == dns.OpcodeUpdate {
		return dns.MsgAccept
	}
	return dns.DefaultMsgAcceptFunc(dh)
}

// listenUDPTCP binds UDP and TCP on the same free loopback port.
func listenUDPTCP(t testing.TB) (net.PacketConn, net.Listener) {
	t.Helper()
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

// ServeDNS answers queries for the zone and applies signed updates.
func (d *DNS) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	if r.Opcode == dns.OpcodeUpdate {
		d.update(w, r, m)
	} else if len(r.Question) == 1 {
		d.answer(r.Question[0], m)
	}
	if r.IsTsig() != nil && w.TsigStatus() == nil {
		m.SetTsig(tsigKeyName, dns.HmacSHA256, 300, time.Now().Unix())
	}
	_ = w.WriteMsg(m)
}

func (d *DNS) update(w dns.ResponseWriter, r, m *dns.Msg) {
	if r.IsTsig() == nil || w.TsigStatus() != nil {
		m.Rcode = dns.RcodeRefused
		return
	}
	for _, rr := range r.Ns {
		txt, ok := rr.(*dns.TXT)
		if !ok {
			continue
		}
		val := strings.Join(txt.Txt, "")
		switch txt.Hdr.Class {
		case dns.ClassINET:
			d.AddTXT(txt.Hdr.Name, val)
		case dns.ClassNONE:
			d.RemoveTXT(txt.Hdr.Name, val)
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

func (d *DNS) answer(q dns.Question, m *dns.Msg) {
	name := strings.ToLower(q.Name)
	zone := ""
	for _, z := range d.zones {
		if name == z+"." || strings.HasSuffix(name, "."+z+".") {
			zone = z + "."
		}
	}
	if zone == "" {
		m.Rcode = dns.RcodeNameError
		return
	}
	m.Authoritative = true
	hdr := dns.RR_Header{Name: q.Name, Rrtype: q.Qtype, Class: dns.ClassINET, Ttl: 1}
	switch q.Qtype {
	case dns.TypeSOA:
		soa := &dns.SOA{Hdr: dns.RR_Header{Name: zone, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 1},
			Ns: "ns." + zone, Mbox: "hostmaster." + zone, Serial: 1, Refresh: 60, Retry: 60, Expire: 60, Minttl: 1}
		if name == zone {
			m.Answer = append(m.Answer, soa)
		} else {
			m.Ns = append(m.Ns, soa) // no data at name: the zone's SOA says whose zone it is
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
