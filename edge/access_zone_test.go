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
	deny, err := parseAccess(nil, []string{"fe80::/10"})
	if err != nil {
		t.Fatal(err)
	}
	allow, err := parseAccess([]string{"fe80::/10"}, nil)
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
