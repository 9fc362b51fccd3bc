package mux

import (
	"os"
	"strconv"
	"strings"
	"sync"
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

// tcpSendRate is what the kernel reckons the socket fd can send, in bytes
// per second: the larger of its pacing rate and its last delivery-rate
// sample; zero where unknown.
func tcpSendRate(fd uintptr) int {
	ti, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return 0
	}
	r := max(ti.Pacing_rate, ti.Delivery_rate)
	if r > 1<<40 { // no pacing: ~0
		r = ti.Delivery_rate
	}
	return int(min(r, 1<<40))
}

// sendBufferFor is the SO_SNDBUF to set for a socket that should hold n
// bytes, from this system's limits (sendBufferSize); zero where they are
// unknown.
func sendBufferFor(n int) int {
	l := wmemLimits()
	if !l.ok {
		return 0
	}
	return sendBufferSize(n, l.auto, l.capped)
}

// wmemLimits are the maximum of net.ipv4.tcp_wmem and net.core.wmem_max,
// read once: every session's socket asks, and they change with a sysctl
// an operator makes before a start.
var wmemLimits = sync.OnceValue(func() (l struct {
	auto, capped int
	ok           bool
}) {
	l.auto, l.ok = procInt("/proc/sys/net/ipv4/tcp_wmem", 2)
	if l.ok {
		l.capped, l.ok = procInt("/proc/sys/net/core/wmem_max", 0)
	}
	return l
})

// procInt reads the i-th integer of a file under /proc/sys.
func procInt(path string, i int) (int, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if i >= len(f) {
		return 0, false
	}
	n, err := strconv.Atoi(f[i])
	return n, err == nil && n > 0
}
