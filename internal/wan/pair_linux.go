//go:build linux

package wan

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// mtu is the TUN devices' MTU, the internet's usual one.
const mtu = 1500

// Addresses of the two sides, inside their own namespaces.
var (
	addrA = netip.MustParseAddr("10.250.0.1")
	addrB = netip.MustParseAddr("10.250.0.2")
)

// namePrefix starts the name of every namespace a Pair makes; the process
// id follows, so that a leftover of a killed run can be told apart.
const namePrefix = "ngwan-"

// Pair is two network namespaces joined by the emulated link. Its zero
// value is ready to Start; Start needs root, /dev/net/tun and ip(8).
type Pair struct {
	A, B *NS // after Start

	ab    *pipe // A to B
	ba    *pipe
	tuns  []*os.File
	wg    sync.WaitGroup
	once  sync.Once
	start bool
}

// AddrA is the address side B reaches side A at; AddrB likewise.
func (p *Pair) AddrA() netip.Addr { return addrA }

// AddrB is the address side A reaches side B at.
func (p *Pair) AddrB() netip.Addr { return addrB }

// Usable says why a Pair cannot Start here, or nil: it needs root,
// /dev/net/tun and ip(8).
func Usable() error {
	if os.Geteuid() != 0 {
		return errors.New("wan: network namespaces need root")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		return fmt.Errorf("wan: no TUN device: %w", err)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("wan: no ip(8): %w", err)
	}
	return nil
}

// Start makes the namespaces and TUN devices and starts forwarding, with
// no delay, loss or limit until Set.
func (p *Pair) Start() error {
	removeStale()
	base := namePrefix + strconv.Itoa(os.Getpid())
	var err error
	if p.A, err = newNS(base + "-a"); err != nil {
		return err
	}
	if p.B, err = newNS(base + "-b"); err != nil {
		p.A.remove()
		return err
	}
	p.start = true
	ta, err := p.A.tun("wan0", addrA, addrB)
	if err != nil {
		p.Close()
		return err
	}
	p.tuns = append(p.tuns, ta)
	tb, err := p.B.tun("wan0", addrB, addrA)
	if err != nil {
		p.Close()
		return err
	}
	p.tuns = append(p.tuns, tb)
	p.ab, p.ba = newPipe(ta, tb, 1), newPipe(tb, ta, 2)
	for _, pp := range []*pipe{p.ab, p.ba} {
		p.wg.Go(pp.read)
		p.wg.Go(pp.deliver)
	}
	return nil
}

// Set applies prof from now on; packets already on their way keep theirs.
func (p *Pair) Set(prof Profile) {
	p.ab.s.set(prof.AtoB)
	p.ba.s.set(prof.BtoA)
}

// Blackhole drops every packet both ways while on, as a cut cable would.
func (p *Pair) Blackhole(on bool) {
	p.ab.s.blackhole(on)
	p.ba.s.blackhole(on)
}

// Stats returns the counts of both directions.
func (p *Pair) Stats() (atob, btoa Stats) { return p.ab.s.stats(), p.ba.s.stats() }

// Close stops forwarding, waits for the forwarder and removes the
// namespaces (and with them their devices). It is idempotent.
func (p *Pair) Close() error {
	var err error
	p.once.Do(func() {
		for _, f := range p.tuns {
			f.Close()
		}
		p.wg.Wait()
		if p.start {
			err = errors.Join(p.A.remove(), p.B.remove())
		}
	})
	return err
}

// NS is a network namespace of a Pair.
type NS struct {
	Name string
	fd   int
}

func newNS(name string) (*NS, error) {
	if err := run("ip", "netns", "add", name); err != nil {
		return nil, err
	}
	fd, err := unix.Open("/run/netns/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		run("ip", "netns", "del", name)
		return nil, fmt.Errorf("open namespace %s: %w", name, err)
	}
	n := &NS{Name: name, fd: fd}
	if err := n.ip("link", "set", "lo", "up"); err != nil {
		n.remove()
		return nil, err
	}
	return n, nil
}

func (n *NS) remove() error {
	unix.Close(n.fd)
	return run("ip", "netns", "del", n.Name)
}

func (n *NS) ip(args ...string) error { return run("ip", append([]string{"-n", n.Name}, args...)...) }

// Do runs f on a thread inside the namespace: the sockets f makes belong
// to it for good, wherever they are used afterwards.
func (n *NS) Do(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("own namespace: %w", err)
			return
		}
		defer unix.Close(self)
		if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter namespace %s: %w", n.Name, err)
			return
		}
		err = f()
		if unix.Setns(self, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread() // else the thread ends with this goroutine
		}
		errc <- err
	}()
	return <-errc
}

// Listen listens inside the namespace.
func (n *NS) Listen(network, addr string) (net.Listener, error) {
	var ln net.Listener
	err := n.Do(func() (err error) {
		ln, err = net.Listen(network, addr)
		return err
	})
	return ln, err
}

// DialContext dials from inside the namespace.
func (n *NS) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := n.Do(func() (err error) {
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// Command is a command to run inside the namespace.
func (n *NS) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// tun makes a TUN device in the namespace, addressed self with peer as the
// other end of its link, and returns its packet file.
func (n *NS) tun(name string, self, peer netip.Addr) (*os.File, error) {
	var f *os.File
	err := n.Do(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("create TUN %s: %w", name, err)
		}
		f = os.NewFile(uintptr(fd), "/dev/net/tun")
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, args := range [][]string{
		{"addr", "add", self.String(), "peer", peer.String(), "dev", name},
		{"link", "set", name, "mtu", strconv.Itoa(mtu), "up"},
	} {
		if err := n.ip(args...); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// removeStale deletes the namespaces of Pairs whose process has gone.
func removeStale() {
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), namePrefix)
		if !ok {
			continue
		}
		pid, _, _ := strings.Cut(rest, "-")
		if _, err := strconv.Atoi(pid); err != nil {
			continue
		}
		if _, err := os.Stat("/proc/" + pid); errors.Is(err, os.ErrNotExist) {
			run("ip", "netns", "del", e.Name())
		}
	}
}
