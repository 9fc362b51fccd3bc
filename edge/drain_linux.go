package edge

import (
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// filtersSockets is true: a listener of this edge's own takes the filter
// of refuseHandshakes.
const filtersSockets = true

// refuseHandshakes makes ln's socket drop every SYN from now on, and
// nothing else: no new handshake starts (a client's SYN is retried, to find
// the socket closed), while those under way still complete. A listening
// socket's filter also sees the last ACK of each handshake, so one that
// dropped everything would leave a client that has its SYN-ACK connected
// in its own eyes, its request sent, and reset when the socket closes.
// The filter runs on the TCP header; a connection it completes inherits
// it, and an established connection is never sent a SYN.
func refuseHandshakes(ln net.Listener) bool {
	return setFilter(ln, []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_B | unix.BPF_ABS, K: 13}, // the TCP flags
		{Code: unix.BPF_JMP | unix.BPF_JSET | unix.BPF_K, K: 0x02, Jt: 0, Jf: 1},
		{Code: unix.BPF_RET | unix.BPF_K, K: 0},          // SYN: dropped
		{Code: unix.BPF_RET | unix.BPF_K, K: 0xffffffff}, // the rest, whole
	})
}

func setFilter(ln net.Listener, prog []unix.SockFilter) bool {
	rc, ok := rawConn(ln)
	if !ok {
		return false
	}
	var err error
	cerr := rc.Control(func(fd uintptr) {
		err = unix.SetsockoptSockFprog(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_FILTER,
			&unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]})
	})
	return cerr == nil && err == nil
}

func rawConn(ln net.Listener) (syscall.RawConn, bool) {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return nil, false
	}
	rc, err := sc.SyscallConn()
	return rc, err == nil
}

// acceptQueued stops ln's socket from completing handshakes and accepts,
// without waiting, up to max connections the kernel has queued on it.
func acceptQueued(ln net.Listener, max int) []net.Conn {
	rc, ok := rawConn(ln)
	if !ok {
		return nil
	}
	// Nothing more reaches the queue (a handshake still under way after
	// the settle of refuseHandshakes is lost), so the read below is all.
	setFilter(ln, []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}})
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
