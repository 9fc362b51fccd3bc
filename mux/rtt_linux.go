package mux

import (
	"time"

	"golang.org/x/sys/unix"
)

// tcpRTT is the kernel's smoothed round trip of the socket fd, or zero.
func tcpRTT(fd uintptr) time.Duration {
	ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return 0
	}
	return time.Duration(ti.Rtt) * time.Microsecond
}
