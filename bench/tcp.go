package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// The tcp phase (-phases tcp): a TCP tunnel's transfers both ways and its
// connection setup (connect to the first byte) at c=1 and c=64, through
// `ngstone tcp`, against the same service reached directly, and in the
// same run frp's tcp proxy (-frp) and the floors (-floor, -muxfloor).

// tcpService is the phase's local service. On each connection it sends one
// byte at once, then reads a command: 'D' sends size bytes and closes,
// 'U' and a count (8 bytes, big-endian) reads that many bytes and answers
// the count (frp's tcp proxy passes no half-close on: a count, not the
// visitor's half-close, ends an upload); anything else, or nothing,
// closes.
type tcpService struct {
	ln   net.Listener
	size int64
	wg   sync.WaitGroup
}

func newTCPService(size int64) (*tcpService, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &tcpService{ln: ln, size: size}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Go(func() { s.serve(c) })
		}
	})
	return s, nil
}

func (s *tcpService) addr() string { return s.ln.Addr().String() }

func (s *tcpService) close() { s.ln.Close() }

func (s *tcpService) serve(c net.Conn) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Minute))
	if _, err := c.Write([]byte{'!'}); err != nil {
		return
	}
	cmd := make([]byte, 1)
	if _, err := io.ReadFull(c, cmd); err != nil {
		return
	}
	switch cmd[0] {
	case 'D':
		io.Copy(c, io.LimitReader(zeros{}, s.size))
	case 'U':
		var want int64
		if binary.Read(c, binary.BigEndian, &want) != nil {
			return
		}
		n, _ := io.Copy(io.Discard, io.LimitReader(c, want))
		binary.Write(c, binary.BigEndian, n)
	}
}

// tcpDial connects to addr and reads the service's first byte.
func tcpDial(addr string) (*net.TCPConn, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(time.Minute))
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		c.Close()
		return nil, fmt.Errorf("first byte: %w", err)
	}
	return c.(*net.TCPConn), nil
}

// tcpDownload is size bytes from the service at addr, in bytes a second.
func tcpDownload(addr string, size int64) (float64, error) {
	c, err := tcpDial(addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	start := time.Now()
	if _, err := c.Write([]byte{'D'}); err != nil {
		return 0, err
	}
	n, err := io.Copy(io.Discard, c)
	if err == nil && n != size {
		err = fmt.Errorf("got %d bytes of %d", n, size)
	}
	return float64(n) / time.Since(start).Seconds(), err
}

// tcpUpload is size bytes to the service at addr, in bytes a second.
func tcpUpload(addr string, size int64) (float64, error) {
	c, err := tcpDial(addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	start := time.Now()
	if _, err := c.Write(binary.BigEndian.AppendUint64([]byte{'U'}, uint64(size))); err != nil {
		return 0, err
	}
	if _, err := io.Copy(c, io.LimitReader(zeros{}, size)); err != nil {
		return 0, err
	}
	var n int64
	if err := binary.Read(c, binary.BigEndian, &n); err != nil {
		return 0, err
	}
	if n != size {
		return 0, fmt.Errorf("the service got %d bytes of %d", n, size)
	}
	return float64(size) / time.Since(start).Seconds(), nil
}

// tcpSetups connects to addr from conc visitors, one connection after
// another each, for d, and returns the median time from the start of a
// connect to the service's first byte, and the connections a second.
func tcpSetups(addr string, conc int, d time.Duration) (time.Duration, float64, error) {
	var mu sync.Mutex
	var times []time.Duration
	var first error
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for range conc {
		wg.Go(func() {
			for time.Now().Before(end) {
				start := time.Now()
				c, err := tcpDial(addr)
				took := time.Since(start)
				mu.Lock()
				if err != nil && first == nil {
					first = err
				}
				if err == nil {
					times = append(times, took)
				}
				mu.Unlock()
				if err != nil {
					return
				}
				c.Close()
			}
		})
	}
	wg.Wait()
	if first != nil {
		return 0, 0, first
	}
	slices.Sort(times)
	return times[len(times)/2], float64(len(times)) / d.Seconds(), nil
}

// startTCPAgent runs `ngstone tcp` for the phase's service on the edge's
// TCP port, and waits until the port answers.
func (b *bench) startTCPAgent() (*proc, error) {
	ca := filepath.Join(b.dir, "edge", "ca.pem")
	_, port, _ := net.SplitHostPort(b.addrs["tcp"])
	args := []string{"tcp", b.tcp.addr(), "--edge", b.addrs["control"], "--ca-file", ca, "--remote-port", port,
		"--log-format", "json", "--inspect=false"}
	p, err := startProc("agent tcp", b.bin, args, b.o.childEnv, filepath.Join(b.dir, "agent-tcp.log"))
	if err != nil {
		return nil, err
	}
	if err := waitTCP(b.addrs["tcp"]); err != nil {
		p.kill()
		return nil, fmt.Errorf("agent tcp: %w", err)
	}
	return p, nil
}

// waitTCP waits until a connection to addr gets the service's first byte.
func waitTCP(addr string) error {
	return waitFor(15*time.Second, func() bool {
		c, err := tcpDial(addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
}

// tcpPhase measures the TCP tunnel and the peers that have one.
func (b *bench) tcpPhase() error {
	if b.o.self {
		return errors.New("the tcp phase runs the ngstone binary, not -self")
	}
	agent, err := b.startTCPAgent()
	if err != nil {
		return err
	}
	defer agent.stop()
	size := b.o.size
	gib := float64(b.o.xfers) * float64(size) / (1 << 30)
	for _, dir := range []struct {
		name string
		f    func(string, int64) (float64, error)
	}{{"download", tcpDownload}, {"upload", tcpUpload}} {
		name := fmt.Sprintf("TCP %s %d MiB", dir.name, size>>20)
		rate := func(addr string) (float64, error) {
			return median(b.o.xfers, func() (float64, error) { return dir.f(addr, size) })
		}
		direct, err := rate(b.tcp.addr())
		if err != nil {
			return fmt.Errorf("%s direct: %w", name, err)
		}
		e0, a0 := b.edge.cpu(), agent.cpu()
		tunnel, err := rate(b.addrs["tcp"])
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		b.add(row{name: name, direct: mibps(direct), tunnel: mibps(tunnel), ratio: pct(tunnel / direct)})
		b.add(row{name: "edge / agent CPU per GiB, " + name,
			tunnel: fmt.Sprintf("%.2f / %.2f s", (b.edge.cpu()-e0).Seconds()/gib, (agent.cpu()-a0).Seconds()/gib)})
		for _, p := range b.peers {
			pt, ok := p.targets["tcp"]
			if !ok {
				continue
			}
			cpu0 := p.cpu()
			r, err := rate(tcpAddr(pt))
			if err != nil {
				return fmt.Errorf("%s: %s: %w", p.name, name, err)
			}
			b.add(row{name: p.name + ": " + name, direct: mibps(direct), tunnel: mibps(r), ratio: pct(r / direct)})
			b.add(row{name: p.name + ": CPU per GiB, all its processes, " + name, tunnel: fmt.Sprintf("%.2f s", (p.cpu()-cpu0).Seconds()/gib)})
		}
	}
	for _, conc := range []int{1, 64} {
		name := fmt.Sprintf("TCP connect to first byte, c=%d", conc)
		setup := func(addr string) (string, string, error) {
			p50, rate, err := tcpSetups(addr, conc, b.o.dur)
			return ms(p50), fmt.Sprintf("%.0f/s", rate), err
		}
		dp, dr, err := setup(b.tcp.addr())
		if err != nil {
			return fmt.Errorf("%s direct: %w", name, err)
		}
		tp, tr, err := setup(b.addrs["tcp"])
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		b.add(row{name: name + " (p50; conns/s)", direct: dp + "; " + dr, tunnel: tp + "; " + tr})
		for _, p := range b.peers {
			pt, ok := p.targets["tcp"]
			if !ok {
				continue
			}
			pp, pr, err := setup(tcpAddr(pt))
			if err != nil {
				return fmt.Errorf("%s: %s: %w", p.name, name, err)
			}
			b.add(row{name: p.name + ": " + name + " (p50; conns/s)", direct: dp + "; " + dr, tunnel: pp + "; " + pr})
		}
	}
	return nil
}

// tcpAddr is a tcp target's address.
func tcpAddr(t target) string { return strings.TrimPrefix(t.base, "tcp://") }
