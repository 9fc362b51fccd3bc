package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// A peer is another way from the visitor to the same backend, measured in
// the same run as ngstone and the direct connection: frp, a popular Go
// tunnel of the kind #6 compares with (-frp DIR), and the floor, two plain
// TCP relay processes that copy bytes and nothing else (-floor): what any
// tunnel of two processes on the path costs on this machine before it does
// TLS, multiplexing or HTTP.
type peer struct {
	name    string
	procs   []*proc
	targets map[string]target // by scheme; a scheme the peer lacks is absent
	// restart, when set, starts the peer's server process (procs[0]) again
	// after the outage phase killed it.
	restart func() error
}

func (p *peer) stop() {
	for _, pr := range p.procs {
		pr.stop()
	}
}

// schemeProcs is the peer's processes that carry scheme's visitors: those
// whose name has it as a word ("mux edge http", "relay http 1"), or all of
// them.
func (p *peer) schemeProcs(scheme string) []*proc {
	var ps []*proc
	for _, pr := range p.procs {
		if slices.Contains(strings.Fields(pr.name), scheme) {
			ps = append(ps, pr)
		}
	}
	if len(ps) == 0 {
		return p.procs
	}
	return ps
}

// procNames names procs as "a / b".
func procNames(procs []*proc) string {
	var names []string
	for _, p := range procs {
		names = append(names, p.name)
	}
	return strings.Join(names, " / ")
}

// cpu is the CPU time of all the peer's processes.
func (p *peer) cpu() time.Duration {
	var d time.Duration
	for _, pr := range p.procs {
		d += pr.cpu()
	}
	return d
}

// startPeers starts the peers the options ask for and waits until each
// answers.
func (b *bench) startPeers() error {
	if b.o.frp != "" {
		p, err := b.startFRP(b.o.frp)
		if err != nil {
			return err
		}
		b.peers = append(b.peers, p)
	}
	if b.o.floor {
		p, err := b.startFloor()
		if err != nil {
			return err
		}
		b.peers = append(b.peers, p)
	}
	if b.o.muxFloor {
		p, err := b.startMuxFloor()
		if err != nil {
			return err
		}
		b.peers = append(b.peers, p)
	}
	if b.o.httpFloor && slices.Contains(b.o.schemes, "http") {
		p, err := b.startHTTPFloor()
		if err != nil {
			return err
		}
		b.peers = append(b.peers, p)
	}
	return nil
}

// startFRP runs frps and frpc from dir with their defaults (TLS and yamux
// between them, as ngstone has) and an HTTP proxy for the backend on frps's
// vhost listener. frp's HTTPS vhost passes TLS through to the backend, so
// it has no figure comparable with ngstone's HTTPS rows.
func (b *bench) startFRP(dir string) (*peer, error) {
	ctl, vhost := freePort(), freePort()
	_, ctlPort, _ := net.SplitHostPort(ctl)
	_, vhostPort, _ := net.SplitHostPort(vhost)
	_, localPort, _ := net.SplitHostPort(strings.TrimPrefix(b.be.plain.URL, "http://"))
	const host = "bench.frp.test"
	files := map[string]string{
		"frps.toml": fmt.Sprintf("bindAddr = \"127.0.0.1\"\nbindPort = %s\nvhostHTTPPort = %s\nlog.level = \"warn\"\n", ctlPort, vhostPort),
		"frpc.toml": fmt.Sprintf("serverAddr = \"127.0.0.1\"\nserverPort = %s\nlog.level = \"warn\"\n\n"+
			"[[proxies]]\nname = \"bench\"\ntype = \"http\"\nlocalIP = \"127.0.0.1\"\nlocalPort = %s\ncustomDomains = [%q]\n",
			ctlPort, localPort, host),
	}
	p := &peer{name: "frp", targets: map[string]target{"http": {base: "http://" + vhost, host: host}}}
	if b.tcp != nil {
		remote := freePort()
		_, remotePort, _ := net.SplitHostPort(remote)
		_, tcpPort, _ := net.SplitHostPort(b.tcp.addr())
		files["frpc.toml"] += fmt.Sprintf("\n[[proxies]]\nname = \"benchtcp\"\ntype = \"tcp\"\nlocalIP = \"127.0.0.1\"\nlocalPort = %s\nremotePort = %s\n", tcpPort, remotePort)
		p.targets["tcp"] = target{base: "tcp://" + remote}
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(b.dir, name), []byte(text), 0o644); err != nil {
			return nil, err
		}
	}
	start := func(side string) (*proc, error) {
		return startProc(side, filepath.Join(dir, side), []string{"-c", filepath.Join(b.dir, side+".toml")},
			b.o.childEnv, filepath.Join(b.dir, side+".log"))
	}
	p.restart = func() error {
		pr, err := start("frps")
		if err != nil {
			return err
		}
		p.procs[0] = pr
		return nil
	}
	p.procs = []*proc{nil}
	if err := p.restart(); err != nil {
		return nil, err
	}
	if waitFor(15*time.Second, func() bool { return canDial(ctl) }) != nil {
		p.stop()
		return nil, errors.New("frps did not listen within 15s; see its log with -keep")
	}
	pr, err := start("frpc")
	if err != nil {
		p.stop()
		return nil, err
	}
	p.procs = append(p.procs, pr)
	return p, b.waitPeer(p)
}

// peerSchemes are what the floors relay: the schemes measured (-schemes),
// and the tcp phase's service.
func (b *bench) peerSchemes() []string {
	var out []string
	for _, s := range b.o.schemes {
		if s == "http" || s == "https" {
			out = append(out, s)
		}
	}
	if b.tcp != nil {
		out = append(out, "tcp")
	}
	return out
}

func canDial(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// startFloor chains two relay processes (this binary) in front of the
// backend's plain and TLS listeners; TLS, for the HTTPS rows, is the
// backend's own, end to end.
func (b *bench) startFloor() (*peer, error) {
	p := &peer{name: "floor", targets: map[string]target{}}
	for _, scheme := range b.peerSchemes() {
		d := b.direct(scheme)
		to := strings.TrimPrefix(d.base, scheme+"://")
		for i := range 2 {
			addr := freePort()
			if err := b.startRole(p, fmt.Sprintf("relay %s %d", scheme, i+1), "relay", "-listen", addr, "-to", to); err != nil {
				return nil, err
			}
			to = addr
		}
		d.base = scheme + "://" + to
		p.targets[scheme] = d
	}
	return p, b.waitPeer(p)
}

// startRole starts this binary as role (a relay of the floor, a side of
// the mux floor) with args and adds it to p's processes; on an error it
// stops p.
func (b *bench) startRole(p *peer, name, role string, args ...string) error {
	self, err := os.Executable()
	if err == nil {
		var pr *proc
		pr, err = startProc(name, self, args, append([]string{roleEnv + "=" + role}, b.o.childEnv...), filepath.Join(b.dir, role+".log"))
		if err == nil {
			p.procs = append(p.procs, pr)
			return nil
		}
	}
	p.stop()
	return err
}

func (b *bench) waitPeer(p *peer) error {
	for scheme, t := range p.targets {
		if scheme == "tcp" {
			if err := waitTCP(tcpAddr(t)); err != nil {
				p.stop()
				return fmt.Errorf("%s: tcp: %w; see its log with -keep", p.name, err)
			}
			continue
		}
		c := t.client(1)
		_, ok := waitOK(t, c, 15*time.Second, 5*time.Millisecond)
		c.CloseIdleConnections()
		if !ok {
			p.stop()
			return fmt.Errorf("%s: %s did not answer within 15s; see its log with -keep", p.name, scheme)
		}
	}
	return nil
}

// runRelay is the floor's relay process: it copies bytes between each
// accepted connection and a new connection to the next hop, until ctx ends.
func runRelay(ctx context.Context, listen, to string) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	return relay(ctx, ln, to)
}

// relay serves ln until ctx ends, then returns ctx's error once every
// connection it accepted has ended.
func relay(ctx context.Context, ln net.Listener, to string) error {
	context.AfterFunc(ctx, func() { ln.Close() })
	var conns sync.WaitGroup
	defer conns.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			return ctx.Err()
		}
		conns.Go(func() {
			defer c.Close()
			u, err := net.Dial("tcp", to)
			if err != nil {
				return
			}
			defer u.Close()
			var wg sync.WaitGroup
			wg.Go(func() { io.Copy(u, c); u.(*net.TCPConn).CloseWrite() })
			io.Copy(c, u)
			c.(*net.TCPConn).CloseWrite()
			wg.Wait()
		})
	}
}
