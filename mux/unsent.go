package mux

import (
	"net"
	"syscall"
)

// DefaultUnsentLimit bounds the TCP_NOTSENT_LOWAT a coalescing connection
// sets on its socket (CoalesceConfig.UnsentLimit).
const DefaultUnsentLimit = maxCoalesce

// setUnsent sets tc to hold at most n bytes not yet sent. Where the system
// has no such option it does nothing.
func setUnsent(tc *net.TCPConn, n int) {
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
