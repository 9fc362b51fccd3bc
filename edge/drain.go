package edge

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/ngstone/ngstone/mux"
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

// listenVisitors listens on plain TCP, not on Go's default multipath TCP
// where the kernel has it: a multipath socket refuses the socket filter by
// which a graceful stop holds off new visitors (refuseHandshakes).
// Visitors that speak multipath TCP are served over one path.
func listenVisitors(network, addr string) (net.Listener, error) {
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	return lc.Listen(context.Background(), network, addr)
}

// maxDrained bounds the connections taken from the accept queue at close
// (the queue is bounded by the listen backlog, somaxconn: 4096 here).
const maxDrained = 4096

// drain stops new handshakes, lets those under way complete for settle
// (or until ctx ends) while Accept goes on as before, then takes the
// accept queue's connections, for Accept to hand out once the listener is
// closed. held is false where new handshakes could not be stopped: then
// those under way at the close are reset.
func (l *drainingListener) drain(ctx context.Context, settle time.Duration) (held bool) {
	if held = refuseHandshakes(l.Listener); held {
		t := time.NewTimer(settle)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		conns := acceptQueued(l.Listener, maxDrained)
		l.mu.Lock()
		l.left = append(l.left, conns...)
		l.mu.Unlock()
	}
	return held
}

// Accept also sets each visitor connection's unsent limit
// (visitorUnsent).
func (l *drainingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil && errors.Is(err, net.ErrClosed) {
		l.mu.Lock()
		defer l.mu.Unlock()
		if len(l.left) > 0 {
			c, l.left = l.left[0], l.left[1:]
			mux.SetUnsentLimit(c, visitorUnsent)
			return c, nil
		}
	}
	if err == nil {
		mux.SetUnsentLimit(c, visitorUnsent)
	}
	return c, err
}

// visitorUnsent bounds what a visitor's socket holds not yet sent
// (TCP_NOTSENT_LOWAT). Without it a response write blocked on a visitor
// who reads slowly waits until half the socket's send buffer is free, which
// autotuning grows to megabytes: a visitor reading steadily at tens of KiB
// a second was cut by --write-timeout as if it had stalled, its write
// never going on within the timeout. With it the write goes on as the
// visitor reads, and a slow visitor costs the kernel this much unsent, not
// a whole buffer. Data in flight is not bounded by it, so a fast visitor's
// rate is not either: 128 KiB is a millisecond of a gigabit link.
const visitorUnsent = 128 << 10

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
