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
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	} else if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
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
	if ip := net.ParseIP(h); ip != nil {
		return ip.String(), nil
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
