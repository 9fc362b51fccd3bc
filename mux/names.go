package mux

import (
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// DefaultReserved are the names no agent may bind unless the operator
// configures another list; auth is the sign-in callback host (--oauth-provider).
var DefaultReserved = []string{"www", "api", "admin", "edge", "mail", "auth"}

// Sentinel errors of name validation.
var (
	// ErrInvalidName: not 1–63 of a-z 0-9 '-', or starts or ends with '-'.
	ErrInvalidName = errors.New("invalid subdomain")
	// ErrReservedName: the name is on the reserved list.
	ErrReservedName = errors.New("reserved subdomain")
	// ErrInvalidHostname: not a hostname of an agent's own
	// (ValidateHostname).
	ErrInvalidHostname = errors.New("invalid hostname")
)

// ValidateSubdomain checks one DNS label against the naming rules. It does
// not lower-case: callers normalise first, so that "App" is refused as
// written rather than silently bound as "app".
func ValidateSubdomain(name string, reserved []string) error {
	if p := labelProblem(name); p != "" {
		return fmt.Errorf("%w %q: %s", ErrInvalidName, name, p)
	}
	if slices.Contains(reserved, name) {
		return fmt.Errorf("%w %q: it is reserved by the edge operator", ErrReservedName, name)
	}
	return nil
}

// labelProblem says what keeps label from being a DNS label of the naming
// rules; "" when nothing does.
func labelProblem(label string) string {
	if len(label) == 0 || len(label) > 63 {
		return "must be 1 to 63 characters"
	}
	for i := 0; i < len(label); i++ {
		c := label[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return "only a-z, 0-9 and '-' are allowed"
		}
	}
	if label[0] == '-' || label[len(label)-1] == '-' {
		return "must not start or end with '-'"
	}
	return ""
}

// ValidateHostname checks a hostname of an agent's own, as the registry
// keys it (lower case, no trailing dot): two labels or more, each one
// ValidateSubdomain takes, 253 characters at most, and not one a browser
// reads as an IPv4 address (endsInNumber: 1.2.3 is 1.2.0.3 to it, and
// 0x7f.0.0.1 is 127.0.0.1).
func ValidateHostname(h string) error {
	switch {
	case len(h) > 253:
		return fmt.Errorf("%w %q: longer than 253 characters", ErrInvalidHostname, h)
	case !strings.Contains(h, "."):
		return fmt.Errorf("%w %q: want two labels or more, such as app.example.org", ErrInvalidHostname, h)
	}
	for label := range strings.SplitSeq(h, ".") {
		if p := labelProblem(label); p != "" {
			return fmt.Errorf("%w %q: label %q: %s", ErrInvalidHostname, h, label, p)
		}
	}
	if endsInNumber(h) {
		return fmt.Errorf("%w %q: it ends in a number, so browsers read it as an IPv4 address", ErrInvalidHostname, h)
	}
	return nil
}

// endsInNumber is the WHATWG URL host parser's "ends in a number" check:
// the last label, or the one before an empty last label, is all digits,
// or 0x (or 0X) and hex digits. A browser then parses the whole host as an
// IPv4 address (or refuses the URL), never as a name.
func endsInNumber(h string) bool {
	h = strings.TrimSuffix(h, ".")
	last := h[strings.LastIndexByte(h, '.')+1:]
	if last != "" && strings.Trim(last, "0123456789") == "" {
		return true
	}
	return len(last) >= 2 && last[0] == '0' && (last[1] == 'x' || last[1] == 'X') &&
		strings.Trim(last[2:], "0123456789abcdefABCDEF") == ""
}

const randomAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// RandomName returns a random valid subdomain of n (at least 8) characters
// that starts with a letter.
func RandomName(n int) string {
	n = max(n, 8)
	b := make([]byte, n)
	rand.Read(b)
	for i := range b {
		alpha := randomAlphabet
		if i == 0 {
			alpha = randomAlphabet[:26]
		}
		b[i] = alpha[int(b[i])%len(alpha)]
	}
	return string(b)
}
