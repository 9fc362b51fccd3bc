//go:build !linux

package edge

import "net"

// acceptQueued takes nothing where the accept queue cannot be read without
// waiting: closing the listener resets what it holds, as before.
func acceptQueued(net.Listener, int) []net.Conn { return nil }

// filtersSockets is false: there is no socket filter here.
const filtersSockets = false

// refuseHandshakes cannot stop handshakes here without closing the
// listener.
func refuseHandshakes(net.Listener) bool { return false }
