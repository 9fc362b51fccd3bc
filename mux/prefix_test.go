package mux

import (
	"net/netip"
	"testing"
)

// TestParsePrefix: prefixes are masked, those in IPv4-mapped form are the
// IPv4 prefixes they mean, and a mapped one of fewer than 96 bits is
// refused.
func TestParsePrefix(t *testing.T) {
	for in, want := range map[string]string{
		"10.1.2.3/8":          "10.0.0.0/8",
		"2001:db8::1/32":      "2001:db8::/32",
		"::ffff:10.0.0.0/104": "10.0.0.0/8",
		"::ffff:10.1.1.1/128": "10.1.1.1/32",
		"::ffff:0:0/96":       "0.0.0.0/0",
		"::ffff:a01:101/120":  "10.1.1.0/24",
		"::/0":                "::/0",
		"::ffff:10.0.0.0/95":  "",
		"::ffff:0:0/0":        "",
		"10.0.0.0":            "",
		"10.0.0.300/8":        "",
		"fe80::1%eth0/64":     "",
	} {
		p, err := ParsePrefix(in)
		switch {
		case want == "" && err == nil:
			t.Errorf("%s: %s, want an error", in, p)
		case want != "" && (err != nil || p != netip.MustParsePrefix(want)):
			t.Errorf("%s: %s %v, want %s", in, p, err, want)
		}
	}
}
