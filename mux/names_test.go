package mux_test

import (
	"errors"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ngstone/ngstone/mux"
)

func TestValidateSubdomain(t *testing.T) {
	tests := map[string]struct {
		name string
		want error
	}{
		"one letter":          {"a", nil},
		"one digit":           {"7", nil},
		"letters and digits":  {"app42", nil},
		"inner hyphen":        {"my-app", nil},
		"double hyphen":       {"xn--bcher-kva", nil},
		"63 characters":       {strings.Repeat("a", 63), nil},
		"starts with digit":   {"1app", nil},
		"empty":               {"", mux.ErrInvalidName},
		"64 characters":       {strings.Repeat("a", 64), mux.ErrInvalidName},
		"leading hyphen":      {"-app", mux.ErrInvalidName},
		"trailing hyphen":     {"app-", mux.ErrInvalidName},
		"only a hyphen":       {"-", mux.ErrInvalidName},
		"upper case":          {"App", mux.ErrInvalidName},
		"all upper case":      {"APP", mux.ErrInvalidName},
		"dot":                 {"a.b", mux.ErrInvalidName},
		"underscore":          {"my_app", mux.ErrInvalidName},
		"space":               {"my app", mux.ErrInvalidName},
		"non-ascii":           {"café", mux.ErrInvalidName},
		"nul":                 {"a\x00", mux.ErrInvalidName},
		"reserved www":        {"www", mux.ErrReservedName},
		"reserved api":        {"api", mux.ErrReservedName},
		"reserved admin":      {"admin", mux.ErrReservedName},
		"reserved edge":       {"edge", mux.ErrReservedName},
		"reserved mail":       {"mail", mux.ErrReservedName},
		"reserved prefix":     {"www1", nil},
		"upper-case reserved": {"WWW", mux.ErrInvalidName},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			err := mux.ValidateSubdomain(tt.name, mux.DefaultReserved)
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Fatalf("ValidateSubdomain(%q) = %v, want %v", tt.name, err, tt.want)
			}
		})
	}
}

func TestValidateSubdomainReservedList(t *testing.T) {
	if err := mux.ValidateSubdomain("www", nil); err != nil {
		t.Fatalf("with no reserved list, www: %v", err)
	}
	if err := mux.ValidateSubdomain("staging", []string{"staging"}); !errors.Is(err, mux.ErrReservedName) {
		t.Fatalf("an operator's reserved name: %v", err)
	}
	want := []string{"www", "api", "admin", "edge", "mail", "auth"}
	if !slices.Equal(mux.DefaultReserved, want) {
		t.Fatalf("DefaultReserved = %v, want %v", mux.DefaultReserved, want)
	}
}

func TestRandomName(t *testing.T) {
	seen := map[string]bool{}
	for _, n := range []int{-1, 0, 1, 7, 8, 12, 63} {
		for range 50 {
			name := mux.RandomName(n)
			if want := max(n, 8); len(name) != want {
				t.Fatalf("RandomName(%d) = %q, want %d characters", n, name, want)
			}
			if err := mux.ValidateSubdomain(name, nil); err != nil {
				t.Fatalf("RandomName(%d) = %q: %v", n, name, err)
			}
			if name[0] < 'a' || name[0] > 'z' {
				t.Fatalf("RandomName(%d) = %q does not start with a letter", n, name)
			}
			seen[name] = true
		}
	}
	// 350 names of at least 36^7 each: a repeat means the source is broken.
	if len(seen) != 350 {
		t.Fatalf("RandomName repeated itself: %d distinct of 350", len(seen))
	}
}

// labelRE is the naming rule written independently of ValidateSubdomain.
var labelRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

func FuzzValidateSubdomain(f *testing.F) {
	for _, s := range []string{"a", "app", "my-app", "-a", "a-", "WWW", "www", strings.Repeat("z", 63), strings.Repeat("z", 64), "a.b", "é", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		err := mux.ValidateSubdomain(name, mux.DefaultReserved)
		reserved := slices.Contains(mux.DefaultReserved, name)
		switch {
		case err == nil && (!labelRE.MatchString(name) || reserved):
			t.Fatalf("ValidateSubdomain accepted %q", name)
		case errors.Is(err, mux.ErrReservedName) && (!reserved || !labelRE.MatchString(name)):
			t.Fatalf("ValidateSubdomain(%q) = %v, but it is not a valid reserved name", name, err)
		case errors.Is(err, mux.ErrInvalidName) && labelRE.MatchString(name):
			t.Fatalf("ValidateSubdomain(%q) = %v, but it is a valid label", name, err)
		case err != nil && !errors.Is(err, mux.ErrInvalidName) && !errors.Is(err, mux.ErrReservedName):
			t.Fatalf("ValidateSubdomain(%q) = %v, not a sentinel error", name, err)
		}
	})
}

func TestValidateHostname(t *testing.T) {
	for name, tt := range map[string]struct {
		host string
		ok   bool
	}{
		"two labels":            {"app.example", true},
		"three labels":          {"app.example.org", true},
		"digits first":          {"123.example.org", true},
		"hex first":             {"0x7f.example.org", true},
		"digits and letters":    {"app.b1", true},
		"not hex":               {"app.0xg", true},
		"253 characters":        {strings.Repeat("a.", 126) + "a", true},
		"one label":             {"localhost", false},
		"254 characters":        {strings.Repeat("a.", 126) + "ab", false},
		"empty label":           {"app..org", false},
		"trailing dot":          {"app.org.", false},
		"leading hyphen":        {"-app.org", false},
		"upper case":            {"App.org", false},
		"64-character label":    {strings.Repeat("a", 64) + ".org", false},
		"IPv4":                  {"127.0.0.1", false},
		"short IPv4":            {"1.2.3", false},
		"hex and dotted":        {"0x7f.0.0.1", false},
		"last label hex":        {"app.0x7f", false},
		"last label 0x":         {"app.0x", false},
		"last label octal":      {"app.017", false},
		"last label digits":     {"app.123", false},
		"IPv6":                  {"::1", false},
		"underscore":            {"my_app.org", false},
		"last label only zeros": {"app.0", false},
	} {
		t.Run(name, func(t *testing.T) {
			err := mux.ValidateHostname(tt.host)
			if tt.ok != (err == nil) || err != nil && !errors.Is(err, mux.ErrInvalidHostname) {
				t.Fatalf("ValidateHostname(%q) = %v, want ok %v", tt.host, err, tt.ok)
			}
		})
	}
}

// hostnameRE and numericRE are the hostname rule written independently of
// ValidateHostname: labels of the naming rule, the last one not what the
// WHATWG URL parser reads as a number.
var (
	hostnameRE = regexp.MustCompile(`^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	numericRE  = regexp.MustCompile(`(^|\.)([0-9]+|0[xX][0-9a-fA-F]*)$`)
)

func FuzzValidateHostname(f *testing.F) {
	for _, s := range []string{"app.example.org", "1.2.3", "0x7f.0.0.1", "app.0x", "app.0xg", "a.b1", "a..b", "a.b.", "-a.b", "localhost", "::1", strings.Repeat("a.", 127)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, host string) {
		err := mux.ValidateHostname(host)
		valid := len(host) <= 253 && hostnameRE.MatchString(host) && !numericRE.MatchString(host)
		switch {
		case err == nil && !valid:
			t.Fatalf("ValidateHostname accepted %q", host)
		case err != nil && valid:
			t.Fatalf("ValidateHostname(%q) = %v, but it is a valid hostname", host, err)
		case err != nil && !errors.Is(err, mux.ErrInvalidHostname):
			t.Fatalf("ValidateHostname(%q) = %v, not ErrInvalidHostname", host, err)
		}
	})
}
