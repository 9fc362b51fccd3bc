//go:build linux || darwin

package mux

import "golang.org/x/sys/unix"

func setNotSentLowat(fd uintptr, n int) {
	unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, n)
}

func getNotSentLowat(fd uintptr) (int, error) {
	return unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT)
}
