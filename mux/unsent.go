package mux

import (
	"net"
	"syscall"
)

// DefaultUnsentLimit is the TCP_NOTSENT_LOWAT a coalescing connection sets
// on its socket (CoalesceConfig.UnsentLimit).
const DefaultUnsentLimit = 32 << 10

// limitUnsent sets the socket beneath c, if c is a TCP connection or TLS
// over one (batched or not), to hold at most n bytes not yet sent. Where
// the system has no such option it does nothing.
func limitUnsent(c net.Conn, n int) {
	tc := tcpUnder(c)
	if tc == nil {
		return
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return
	}
	rc.Control(func(fd uintptr) { setNotSentLowat(fd, n) })
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
