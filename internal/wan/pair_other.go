//go:build !linux

package wan

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os/exec"
)

// Pair needs Linux's network namespaces and TUN devices; elsewhere Start
// fails.
type Pair struct{ A, B *NS }

// NS is a network namespace of a Pair.
type NS struct{ Name string }

var errUnsupported = errors.New("wan: network namespaces need Linux")

// Usable says why a Pair cannot Start here.
func Usable() error { return errUnsupported }

func (p *Pair) Start() error                              { return errUnsupported }
func (p *Pair) Set(Profile)                               {}
func (p *Pair) Blackhole(bool)                            {}
func (p *Pair) Stats() (atob, btoa Stats)                 { return }
func (p *Pair) Close() error                              { return nil }
func (p *Pair) AddrA() netip.Addr                         { return netip.Addr{} }
func (p *Pair) AddrB() netip.Addr                         { return netip.Addr{} }
func (n *NS) Listen(string, string) (net.Listener, error) { return nil, errUnsupported }
func (n *NS) DialContext(context.Context, string, string) (net.Conn, error) {
	return nil, errUnsupported
}
func (n *NS) Command(name string, args ...string) *exec.Cmd { return exec.Command(name, args...) }
