package edge

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// ErrBadHost is returned by NormalizeHost for an empty or malformed Host.
var ErrBadHost = errors.New("bad host")

// NormalizeHost lower-cases a Host header value and drops its port and a
// trailing dot. The result is either a non-empty string of DNS characters
// (letters, digits, '-', '.') or an error; NormalizeHost(NormalizeHost(h))
// is NormalizeHost(h).
func NormalizeHost(h string) (string, error) {
	if h == "" {
		return "", fmt.Errorf("%w: empty", ErrBadHost)
	}
	// A name with no colon has no port: net.SplitHostPort would fail, and
	// make an error to say so, on every request for such a name.
	split := false
	if strings.IndexByte(h, ':') >= 0 {
		if host, _, err := net.SplitHostPort(h); err == nil {
			h, split = host, true
		}
	}
	if !split && strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		h = h[1 : len(h)-1]
	}
	for i := 0; i < len(h); i++ {
		// Before lower-casing: ToLower maps some non-ASCII runes (the
		// Kelvin sign) onto ASCII letters, which would change a name's identity.
		if h[i] >= 0x80 {
			return "", fmt.Errorf("%w: non-ASCII byte %#x (use the punycode form)", ErrBadHost, h[i])
		}
	}
	h = strings.TrimSuffix(strings.ToLower(h), ".")
	if h == "" || len(h) > 253 {
		return "", fmt.Errorf("%w: length %d", ErrBadHost, len(h))
	}
	if mayBeIP(h) {
		if ip := net.ParseIP(h); ip != nil {
			return ip.String(), nil
		}
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.') {
			return "", fmt.Errorf("%w: character %q", ErrBadHost, c)
		}
	}
	if strings.HasPrefix(h, ".") || strings.HasSuffix(h, ".") || strings.Contains(h, "..") {
		return "", fmt.Errorf("%w: empty label", ErrBadHost)
	}
	return h, nil
}

// mayBeIP reports whether net.ParseIP could read h: an IPv6 address has a
// colon, an IPv4 one only digits and dots. For any other name ParseIP
// would make an error it returns no part of.
func mayBeIP(h string) bool {
	if strings.IndexByte(h, ':') >= 0 {
		return true
	}
	for i := 0; i < len(h); i++ {
		if (h[i] < '0' || h[i] > '9') && h[i] != '.' {
			return false
		}
	}
	return true
}
