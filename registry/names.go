package registry

import (
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
)

// DefaultReserved are the names no agent may bind unless the operator
// configures another list.
var DefaultReserved = []string{"www", "api", "admin", "edge", "mail"}

// Sentinel errors of name validation.
var (
	// ErrInvalidName: not 1–63 of a-z 0-9 '-', or starts or ends with '-'.
	ErrInvalidName = errors.New("invalid subdomain")
	// ErrReservedName: the name is on the reserved list.
	ErrReservedName = errors.New("reserved subdomain")
)

// ValidateSubdomain checks one DNS label against the naming rules. It does
// not lower-case: callers normalise first, so that "App" is refused as
// written rather than silently bound as "app".
func ValidateSubdomain(name string, reserved []string) error {
	if len(name) == 0 || len(name) > 63 {
		return fmt.Errorf("%w %q: must be 1 to 63 characters", ErrInvalidName, name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return fmt.Errorf("%w %q: only a-z, 0-9 and '-' are allowed", ErrInvalidName, name)
		}
	}
	if name[0] == '-' || name[len(name)-1] == '-' {
		return fmt.Errorf("%w %q: must not start or end with '-'", ErrInvalidName, name)
	}
	if slices.Contains(reserved, name) {
		return fmt.Errorf("%w %q: it is reserved by the edge operator", ErrReservedName, name)
	}
	return nil
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
