//go:build unix

package agent

import (
	"io"
	"net"
	"syscall"
)

// watchedUnix reads its socket itself, through syscall.RawConn, so that a
// read and the check of an idle connection (idle) never interleave.
type watchedUnix struct {
	*watchedConn
	rc syscall.RawConn
}

func newWatchedConn(a *Agent, c net.Conn) net.Conn {
	w := &watchedConn{Conn: c, a: a}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return w
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return w
	}
	return &watchedUnix{watchedConn: w, rc: rc}
}

func (c *watchedUnix) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	var err error
	rerr := c.rc.Read(func(fd uintptr) bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.poisoned.Load() {
			err = errStrayBytes
			return true
		}
		for {
			n, err = syscall.Read(int(fd), p)
			if err != syscall.EINTR {
				break
			}
		}
		if err == syscall.EAGAIN {
			return false // wait until the socket is readable
		}
		if n > 0 {
			c.read += int64(n)
		}
		return true
	})
	switch {
	case rerr != nil:
		return 0, rerr // a deadline, or the connection closed
	case err != nil:
		return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
	case n <= 0:
		return 0, io.EOF
	}
	return n, nil
}

// idle returns the bytes read so far, and whether nothing is waiting on the
// socket: neither bytes nor its end. It holds the lock a read holds.
func (c *watchedUnix) idle() (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	waiting := false
	c.rc.Control(func(fd uintptr) {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		waiting = err == nil && n >= 0 // a byte, or the end (n == 0)
	})
	return c.read, !waiting && !c.poisoned.Load()
}
