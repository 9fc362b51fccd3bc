//go:build unix

package agent

import (
	"io"
	"net"
	"sync"
	"syscall"
)

// watchedUnix reads its socket itself, through syscall.RawConn, so that a
// read and the check of an idle connection (idle) never interleave. The
// functions it hands the RawConn are made once per connection, with their
// arguments and results in its fields: a read costs no allocation.
type watchedUnix struct {
	*watchedConn
	rc syscall.RawConn

	readMu sync.Mutex // one Read at a time uses the fields below
	buf    []byte
	n      int
	err    error
	readFn func(fd uintptr) bool

	waiting bool // under mu: what peekFn saw
	peekFn  func(fd uintptr)
}

var _ watched = (*watchedUnix)(nil)

func newWatchedConn(t *tunnel, c net.Conn) net.Conn {
	w := &watchedConn{Conn: c, t: t}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return w
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return w
	}
	u := &watchedUnix{watchedConn: w, rc: rc}
	u.readFn, u.peekFn = u.readFd, u.peekFd
	return u
}

func (c *watchedUnix) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.readMu.Lock()
	defer c.readMu.Unlock()
	c.buf, c.n, c.err = p, 0, nil
	rerr := c.rc.Read(c.readFn)
	n, err := c.n, c.err
	c.buf, c.err = nil, nil
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

// readFd reads fd into buf under mu, counting what it read; false: wait
// until the socket is readable.
func (c *watchedUnix) readFd(fd uintptr) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.poisoned.Load() {
		c.err = errStrayBytes
		return true
	}
	for {
		c.n, c.err = syscall.Read(int(fd), c.buf)
		if c.err != syscall.EINTR {
			break
		}
	}
	if c.err == syscall.EAGAIN {
		c.err = nil
		return false
	}
	if c.n > 0 {
		if c.read == 0 {
			c.noteFirst(c.buf[:c.n])
		}
		c.read += int64(c.n)
	}
	return true
}

// idle returns the bytes read so far, and whether nothing is waiting on the
// socket: neither bytes nor its end. It holds the lock a read holds.
func (c *watchedUnix) idle() (int64, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.waiting = false
	c.rc.Control(c.peekFn)
	return c.read, !c.waiting && !c.poisoned.Load()
}

// peekFd looks for a byte or the end on fd, under mu.
func (c *watchedUnix) peekFd(fd uintptr) {
	var b [1]byte
	n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	c.waiting = err == nil && n >= 0 // a byte, or the end (n == 0)
}
