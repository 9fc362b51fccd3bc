package edge

import (
	"errors"
	"net"
	"strings"
	"testing"
)

func TestNormalizeHost(t *testing.T) {
	long := strings.Repeat("a.", 126) + "b" // 253 characters
	tests := map[string]struct {
		in, want string // want "" means ErrBadHost
	}{
		"plain":                 {"app.example.com", "app.example.com"},
		"upper case":            {"App.Example.COM", "app.example.com"},
		"port":                  {"app.example.com:8443", "app.example.com"},
		"trailing dot":          {"app.example.com.", "app.example.com"},
		"trailing dot and port": {"APP.example.com.:80", "app.example.com"},
		"single label":          {"localhost", "localhost"},
		"ipv4":                  {"127.0.0.1", "127.0.0.1"},
		"ipv4 and port":         {"127.0.0.1:8080", "127.0.0.1"},
		"ipv6 and port":         {"[::1]:80", "::1"},
		"ipv6 in brackets":      {"[::1]", "::1"},
		"bare ipv6":             {"::1", "::1"},
		"ipv6 upper case":       {"[FE80::ABCD]:443", "fe80::abcd"},
		"ipv4-mapped ipv6":      {"[::ffff:127.0.0.1]", "127.0.0.1"},
		"253 characters":        {long, long},
		"253 and trailing dot":  {long + ".", long},
		"empty":                 {"", ""},
		"only a port":           {":80", ""},
		"only a dot":            {".", ""},
		"two trailing dots":     {"app.example.com..", ""},
		"two dots and port":     {"app..:80", ""},
		"empty label":           {"app..example.com", ""},
		"leading dot":           {".example.com", ""},
		"double dot":            {"..", ""},
		"254 characters":        {"c" + long, ""},
		"space":                 {"app example.com", ""},
		"underscore":            {"my_app.example.com", ""},
		"slash":                 {"app.example.com/x", ""},
		"at sign":               {"user@app.example.com", ""},
		"non-ascii":             {"évil.example.com", ""},
		"nul":                   {"app\x00.example.com", ""},
		"crlf":                  {"app.example.com\r\nX: y", ""},
		"unclosed bracket":      {"[::1", ""},
		"ipv6 zone":             {"[fe80::1%25eth0]:80", ""},
		"brackets only":         {"[]", ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got, err := NormalizeHost(tt.in)
			if tt.want == "" {
				if !errors.Is(err, ErrBadHost) {
					t.Fatalf("NormalizeHost(%q) = %q, %v; want ErrBadHost", tt.in, got, err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("NormalizeHost(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			}
		})
	}
}

// FuzzNormalizeHost checks NormalizeHost's promise: an error, or a
// non-empty canonical IP or DNS name that normalises to itself.
func FuzzNormalizeHost(f *testing.F) {
	for _, h := range []string{"app.example.com", "App.Example.COM.:443", "[::1]:80", "127.0.0.1", "a..", ".", "[::ffff:1.2.3.4]"} {
		f.Add(h)
	}
	f.Fuzz(func(t *testing.T, h string) {
		n, err := NormalizeHost(h)
		if err != nil {
			if !errors.Is(err, ErrBadHost) {
				t.Fatalf("NormalizeHost(%q): %v is not ErrBadHost", h, err)
			}
			return
		}
		if ip := net.ParseIP(n); ip != nil {
			if ip.String() != n {
				t.Fatalf("NormalizeHost(%q) = %q, not the canonical %q", h, n, ip.String())
			}
		} else if !dnsName(n) {
			t.Fatalf("NormalizeHost(%q) = %q, not a DNS name", h, n)
		}
		again, err := NormalizeHost(n)
		if err != nil || again != n {
			t.Fatalf("NormalizeHost(%q) = %q, but NormalizeHost(%q) = %q, %v", h, n, n, again, err)
		}
	})
}

// FuzzNormalizeHostShortcuts: NormalizeHost skips net.SplitHostPort for a
// host with no colon and net.ParseIP for one that cannot be an address;
// what it returns is what it returned calling both always.
func FuzzNormalizeHostShortcuts(f *testing.F) {
	for _, h := range []string{"app.example.com", "App.Example.COM.:443", "[::1]:80", "[::1]", "[app]", "127.0.0.1", "127.0.0.1:8080",
		"1.2.3", "01.2.3.4", "1.2.3.4.", "::ffff:1.2.3.4", "[fe80::1%25eth0]:80", ":80", "[]", "a:b:c"} {
		f.Add(h)
	}
	f.Fuzz(func(t *testing.T, h string) {
		got, err := NormalizeHost(h)
		want, werr := normalizeHostAlways(h)
		if got != want || (err == nil) != (werr == nil) {
			t.Fatalf("NormalizeHost(%q) = %q, %v; calling both always: %q, %v", h, got, err, want, werr)
		}
	})
}

// normalizeHostAlways is NormalizeHost as it was before its shortcuts.
func normalizeHostAlways(h string) (string, error) {
	if h == "" {
		return "", ErrBadHost
	}
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	} else if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		h = h[1 : len(h)-1]
	}
	for i := 0; i < len(h); i++ {
		if h[i] >= 0x80 {
			return "", ErrBadHost
		}
	}
	h = strings.TrimSuffix(strings.ToLower(h), ".")
	if h == "" || len(h) > 253 {
		return "", ErrBadHost
	}
	if ip := net.ParseIP(h); ip != nil {
		return ip.String(), nil
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.') {
			return "", ErrBadHost
		}
	}
	if strings.HasPrefix(h, ".") || strings.HasSuffix(h, ".") || strings.Contains(h, "..") {
		return "", ErrBadHost
	}
	return h, nil
}

// dnsName reports whether s is non-empty labels of [a-z0-9-] joined by dots.
func dnsName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || strings.Trim(label, "abcdefghijklmnopqrstuvwxyz0123456789-") != "" {
			return false
		}
	}
	return true
}
