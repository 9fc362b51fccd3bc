//go:build !unix

package agent

import "net"

// socketIdle reports whether a read on c would wait; see aliveByDeadline.
func socketIdle(c net.Conn) bool { return aliveByDeadline(c) }
