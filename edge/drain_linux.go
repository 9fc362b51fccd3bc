package edge

import (
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// acceptQueued stops ln's socket from completing handshakes and accepts,
// without waiting, up to max connections the kernel has queued on it.
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
		// Refuse new handshakes first (a filter that drops every packet
		// on the listening socket: their SYNs are retried, to find it
		// closed), so that the queue read below is all there will be.
		drop := []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}
		unix.SetsockoptSockFprog(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &unix.SockFprog{Len: 1, Filter: &drop[0]})
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
