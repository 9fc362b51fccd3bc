package edge

import (
	"net/netip"
	"testing"
)

// TestAccessZonedAddress: a visitor on the edge's own link, at a link-local
// address with its zone (fe80::1%eth0, as the socket reports it), is judged
// by the address: netip's Contains matches no prefix for a zoned address,
// so a --deny-cidr let it in and an --allow-cidr kept it out.
func TestAccessZonedAddress(t *testing.T) {
	zoned := netip.MustParseAddr("fe80::1%eth0")
	deny, err := parseAccess(nil, []string{"fe80::/10"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	allow, err := parseAccess([]string{"fe80::/10"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if deny.allows(zoned) {
		t.Errorf("--deny-cidr fe80::/10 let %s in", zoned)
	}
	if !allow.allows(zoned) {
		t.Errorf("--allow-cidr fe80::/10 kept %s out", zoned)
	}
}

// TestAccessMappedPrefixes: the prefixes of a bind in IPv4-mapped form, as
// an agent that does not unmap them sends them, are the IPv4 prefixes they
// mean, for the deny list and the allow list; one of fewer than 96 bits,
// which reaches past the mapped addresses, refuses the bind.
func TestAccessMappedPrefixes(t *testing.T) {
	in, out := netip.MustParseAddr("10.1.1.1"), netip.MustParseAddr("11.0.0.1")
	deny, err := parseAccess(nil, []string{"::ffff:10.0.0.0/104"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	allow, err := parseAccess([]string{"::ffff:10.0.0.0/104"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if deny.allows(in) || !deny.allows(out) {
		t.Errorf("--deny-cidr ::ffff:10.0.0.0/104: %s let in %v, %s %v; want %s kept out alone", in, deny.allows(in), out, deny.allows(out), in)
	}
	if !allow.allows(in) || allow.allows(out) {
		t.Errorf("--allow-cidr ::ffff:10.0.0.0/104: %s let in %v, %s %v; want %s let in alone", in, allow.allows(in), out, allow.allows(out), in)
	}
	for _, p := range []string{"::ffff:10.0.0.0/95", "::ffff:0:0/0"} {
		if _, err := parseAccess(nil, []string{p}, nil); err == nil {
			t.Errorf("--deny-cidr %s accepted", p)
		}
	}
}
