package edge

import (
	"errors"
	"net"
	"sync"
)

// drainingListener is a visitor listener whose graceful close first takes
// the connections the kernel has already completed but nobody accepted
// (its accept queue): closing a listening socket resets them, and their
// visitors, whose requests may already be on the way, would get nothing.
// Accept hands them out, through whatever wraps the listener (limits,
// PROXY protocol), before it reports the close.
type drainingListener struct {
	net.Listener

	mu   sync.Mutex
	left []net.Conn
}

// maxDrained bounds the connections taken from the accept queue at close
// (the queue is bounded by the listen backlog, somaxconn: 4096 here).
const maxDrained = 4096

// drain takes the accept queue's connections, for Accept to hand out
// once the listener is closed.
func (l *drainingListener) drain() {
	conns := acceptQueued(l.Listener, maxDrained)
	l.mu.Lock()
	l.left = append(l.left, conns...)
	l.mu.Unlock()
}

func (l *drainingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil && errors.Is(err, net.ErrClosed) {
		l.mu.Lock()
		defer l.mu.Unlock()
		if len(l.left) > 0 {
			c, l.left = l.left[0], l.left[1:]
			return c, nil
		}
	}
	return c, err
}

// discard closes what drain took and nobody accepted (a hard close).
func (l *drainingListener) discard() {
	l.mu.Lock()
	left := l.left
	l.left = nil
	l.mu.Unlock()
	for _, c := range left {
		c.Close()
	}
}
