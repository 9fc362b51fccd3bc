//go:build unix

package agent

import (
	"net"
	"syscall"
)

// socketIdle peeks at c's socket without blocking or consuming: idle means
// the read would wait (no bytes, no end). A read with a deadline cannot
// say so reliably: a deadline short enough not to wait has often passed
// before the read reaches the socket, and then it reports a timeout for a
// connection the peer has closed.
func socketIdle(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return aliveByDeadline(c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	idle := false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, rerr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		idle = rerr == syscall.EAGAIN || rerr == syscall.EWOULDBLOCK
		return true // never wait for readiness
	})
	return err == nil && idle
}
