package mux

import (
	"net"
	"syscall"
)

// DefaultUnsentLimit bounds the TCP_NOTSENT_LOWAT a coalescing connection
// sets on its socket (CoalesceConfig.UnsentLimit): 20 ms of 52 MB/s, so
// what a fast link's socket holds unsent stays a megabyte.
const DefaultUnsentLimit = 1 << 20

// setUnsent sets tc to hold at most n bytes not yet sent. Where the system
// has no such option it does nothing.
func setUnsent(tc *net.TCPConn, n int) {
	rc, err := tc.SyscallConn()
	if err != nil {
		return
	}
	rc.Control(func(fd uintptr) { setNotSentLowat(fd, n) })
}

// SetUnsentLimit sets the TCP connection beneath c (through TLS and
// batching) to hold at most n bytes not yet sent, where the system has the
// option: a write blocked on the socket then goes on as soon as what it
// holds unsent falls under n, not once half the socket's buffer is free,
// and the kernel holds no more than n unsent bytes for a slow reader.
func SetUnsentLimit(c net.Conn, n int) {
	if tc := tcpUnder(c); tc != nil {
		setUnsent(tc, n)
	}
}

// sendBufferSize is the SO_SNDBUF for a socket that should hold n bytes,
// where the kernel's autotuning grows its buffer to auto at most (the
// maximum of net.ipv4.tcp_wmem) and caps SO_SNDBUF at capped
// (net.core.wmem_max), then doubles it, its allowance for its own
// overhead, which autotuning counts within auto. Zero, leaving autotuning
// be, where that reaches as far: setting SO_SNDBUF turns autotuning off
// for the socket, so a smaller cap (wmem_max is 208 KiB on many systems)
// would only lower it.
func sendBufferSize(n, auto, capped int) int {
	if n <= 0 || 2*min(n, capped) <= auto {
		return 0
	}
	return min(n, capped)
}

// sendRate is tc's send rate as the kernel reckons it, bytes per second;
// zero where unknown.
func sendRate(tc *net.TCPConn) int {
	rc, err := tc.SyscallConn()
	if err != nil {
		return 0
	}
	r := 0
	rc.Control(func(fd uintptr) { r = tcpSendRate(fd) })
	return r
}

// tcpUnder returns the TCP connection beneath c, or nil.
func tcpUnder(c net.Conn) *net.TCPConn {
	for {
		switch cc := c.(type) {
		case *net.TCPConn:
			return cc
		case *batchedConn:
			c = cc.Conn
		case interface{ NetConn() net.Conn }: // *tls.Conn
			c = cc.NetConn()
		default:
			return nil
		}
	}
}

// unsentLimit reads back the TCP_NOTSENT_LOWAT beneath c (tests).
func unsentLimit(c net.Conn) (int, error) {
	tc := tcpUnder(c)
	if tc == nil {
		return 0, syscall.ENOTSOCK
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var gerr error
	if err := rc.Control(func(fd uintptr) { n, gerr = getNotSentLowat(fd) }); err != nil {
		return 0, err
	}
	return n, gerr
}
