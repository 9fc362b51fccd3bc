//go:build !unix

package agent

import "net"

// Without a way to read the socket itself, a watched connection makes the
// second check only (no response before its request).
func newWatchedConn(t *tunnel, c net.Conn) net.Conn { return &watchedConn{Conn: c, t: t} }
