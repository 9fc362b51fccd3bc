package mux

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// A public TCP port is bound in the registry under the key TCPKey(port):
// "tcp:PORT". No visitor's Host can name it, since a normalized Host never
// holds a colon, so a TCP binding is never reached over HTTP.

// tcpKeyPrefix begins every TCP port's registry key.
const tcpKeyPrefix = "tcp:"

// TCPKey is the registry key of public TCP port port.
func TCPKey(port int) string { return tcpKeyPrefix + strconv.Itoa(port) }

// ParseTCPKey returns the port of a TCPKey; false for any other key.
func ParseTCPKey(key string) (int, bool) {
	s, ok := strings.CutPrefix(key, tcpKeyPrefix)
	if !ok {
		return 0, false
	}
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 || strconv.Itoa(p) != s {
		return 0, false
	}
	return p, true
}

// The fields of a TCP tunnel's exchange that say where its visitor came
// from and what of the edge's it connected to (HOST:PORT each). The edge
// sets them on the exchanges it makes itself; a visitor's HTTP request
// never carries them (Ngstone-* fields are dropped).
const (
	HeaderTCPSource      = "Ngstone-Tcp-Source"
	HeaderTCPDestination = "Ngstone-Tcp-Destination"
)

// ErrInvalidPorts: a port list is not PORT or LO-HI items of 1–65535.
var ErrInvalidPorts = errors.New("invalid port list")

// PortRange is an inclusive range of TCP ports.
type PortRange struct{ Lo, Hi int }

// Contains reports whether p is in r.
func (r PortRange) Contains(p int) bool { return p >= r.Lo && p <= r.Hi }

func (r PortRange) String() string {
	if r.Lo == r.Hi {
		return strconv.Itoa(r.Lo)
	}
	return fmt.Sprintf("%d-%d", r.Lo, r.Hi)
}

// ParsePorts reads a port list: items PORT or LO-HI, separated by commas
// or given as several strings ("20000-20999", "22022,22023").
func ParsePorts(items ...string) ([]PortRange, error) {
	var out []PortRange
	for _, item := range items {
		for _, s := range strings.Split(item, ",") {
			s = strings.TrimSpace(s)
			if s == "" {
				continue
			}
			r, err := parseRange(s)
			if err != nil {
				return nil, err
			}
			out = append(out, r)
		}
	}
	return out, nil
}

func parseRange(s string) (PortRange, error) {
	lo, hi, isRange := strings.Cut(s, "-")
	if !isRange {
		hi = lo
	}
	a, errA := port(lo)
	b, errB := port(hi)
	if errA != nil || errB != nil || a > b {
		return PortRange{}, fmt.Errorf("%w: %q is not PORT or LO-HI with 1 <= LO <= HI <= 65535", ErrInvalidPorts, s)
	}
	return PortRange{a, b}, nil
}

// port reads a port number written with digits alone.
func port(s string) (int, error) {
	if s == "" || len(s) > 5 || strings.TrimLeft(s, "0123456789") != "" {
		return 0, ErrInvalidPorts
	}
	p, _ := strconv.Atoi(s)
	if p < 1 || p > 65535 {
		return 0, ErrInvalidPorts
	}
	return p, nil
}

// PortsContain reports whether p is in one of rs.
func PortsContain(rs []PortRange, p int) bool {
	for _, r := range rs {
		if r.Contains(p) {
			return true
		}
	}
	return false
}

// PortsString writes rs as ParsePorts reads them.
func PortsString(rs []PortRange) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = r.String()
	}
	return strings.Join(s, ",")
}
