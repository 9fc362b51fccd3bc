package edge

import (
	"net"
	"os"
	"syscall"
)

// acceptQueued accepts, without waiting, up to max connections the
// kernel has queued on ln.
func acceptQueued(ln net.Listener, max int) []net.Conn {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	var fds []int
	rc.Control(func(fd uintptr) {
		for len(fds) < max {
			nfd, _, err := syscall.Accept4(int(fd), syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC)
			if err == syscall.EINTR {
				continue
			}
			if err != nil {
				return // EAGAIN: the queue is empty
			}
			fds = append(fds, nfd)
		}
	})
	var out []net.Conn
	for _, fd := range fds {
		f := os.NewFile(uintptr(fd), "visitor")
		c, err := net.FileConn(f) // a dup of fd, in the runtime's poller
		f.Close()
		if err == nil {
			out = append(out, c)
		}
	}
	return out
}
