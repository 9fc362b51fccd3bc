package mux_test

import (
	"errors"
	"slices"
	"strconv"
	"testing"

	"github.com/ngstone/ngstone/mux"
)

func TestParsePorts(t *testing.T) {
	for in, want := range map[string][]mux.PortRange{
		"20000-20999":       {{Lo: 20000, Hi: 20999}},
		"22022, 1-2,,65535": {{Lo: 22022, Hi: 22022}, {Lo: 1, Hi: 2}, {Lo: 65535, Hi: 65535}},
		"":                  nil,
	} {
		got, err := mux.ParsePorts(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("ParsePorts(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"0", "65536", "20-10", "a", "1-", "-5", "1-2-3", "+5", " 5 5"} {
		if _, err := mux.ParsePorts(in); !errors.Is(err, mux.ErrInvalidPorts) {
			t.Errorf("ParsePorts(%q): %v, want ErrInvalidPorts", in, err)
		}
	}
}

// FuzzParsePorts: a list ParsePorts reads is written back by PortsString
// as a list it reads the same; every port of it is 1–65535, and each
// port's key reads back as that port.
func FuzzParsePorts(f *testing.F) {
	for _, s := range []string{"20000-20999", "22,80-81", "0", "65535", "1-65535", "5-3", ",", "+7"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		rs, err := mux.ParsePorts(s)
		if err != nil {
			return
		}
		again, err := mux.ParsePorts(mux.PortsString(rs))
		if err != nil || !slices.Equal(again, rs) {
			t.Fatalf("%q: %v written as %q reads %v, %v", s, rs, mux.PortsString(rs), again, err)
		}
		for _, r := range rs {
			if r.Lo < 1 || r.Hi > 65535 || r.Lo > r.Hi {
				t.Fatalf("%q: range %v", s, r)
			}
			for _, p := range []int{r.Lo, r.Hi} {
				if got, ok := mux.ParseTCPKey(mux.TCPKey(p)); !ok || got != p {
					t.Fatalf("port %d: key %q reads %d, %v", p, mux.TCPKey(p), got, ok)
				}
			}
		}
	})
}

// FuzzParseTCPKey: a key ParseTCPKey reads is exactly TCPKey of its port.
func FuzzParseTCPKey(f *testing.F) {
	for _, s := range []string{"tcp:22", "tcp:022", "tcp:0", "tcp:65536", "tcp:+1", "tcp:", "web.example.org"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, ok := mux.ParseTCPKey(s)
		if ok != (s == mux.TCPKey(p) && p >= 1 && p <= 65535) {
			t.Fatalf("%q: port %d, %v; TCPKey gives %q", s, p, ok, mux.TCPKey(p))
		}
		if ok && strconv.Itoa(p) != s[len("tcp:"):] {
			t.Fatalf("%q read as %d", s, p)
		}
	})
}
