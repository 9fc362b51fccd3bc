package mux

import (
	"errors"
	"net/netip"
)

// ParsePrefix reads one of a Bind's AllowCIDR or DenyCIDR prefixes as the
// edge matches it, masked. The edge matches a visitor's address unmapped
// (an IPv4 visitor is 10.1.1.1, never ::ffff:10.1.1.1), so a prefix in
// IPv4-mapped form is the IPv4 prefix it means (::ffff:10.0.0.0/104 is
// 10.0.0.0/8): kept as written it would match no visitor, and a deny
// list would let everyone in. One of fewer than 96 bits reaches past the
// mapped addresses, so it is no IPv4 prefix: an error.
func ParsePrefix(s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, errPrefixSyntax
	}
	if a := p.Addr(); a.Is4In6() {
		if p.Bits() < 96 {
			return netip.Prefix{}, errMappedPrefix
		}
		p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p.Masked(), nil
}

var (
	errPrefixSyntax = errors.New("want a prefix such as 192.0.2.0/24 or 2001:db8::/32")
	errMappedPrefix = errors.New("an IPv4-mapped prefix (::ffff:a.b.c.d/N) needs 96 bits or more to be an IPv4 one: write the IPv4 prefix (a.b.c.d/N-96)")
)
