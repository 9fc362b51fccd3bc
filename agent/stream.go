package agent

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The agent serves the edge's streams with net/http's server: each stream
// is a keep-alive connection that carries the edge's exchanges one after
// another, and each exchange is relayed by httputil.ReverseProxy to the
// local service (proxy.go). So the framing the agent reads from the edge
// and writes back is net/http's, the same code the edge reads it with.

// streamIdleTimeout is how long an idle stream waits for its next request:
// longer than the edge keeps one idle, so that the edge, which knows when
// it takes a stream, is the one to close it.
const streamIdleTimeout = 2 * time.Minute

// newStreamServer returns the server of one session's streams. Each stream
// holds up the session's drain (held) while an exchange runs on it.
func (a *Agent) newStreamServer() *http.Server {
	return &http.Server{
		Handler:                      http.HandlerFunc(a.serveExchange),
		ReadHeaderTimeout:            a.cfg.DialTimeout,
		IdleTimeout:                  streamIdleTimeout,
		MaxHeaderBytes:               mux.MaxRequestHead,
		DisableGeneralOptionsHandler: true, // OPTIONS * is the local service's to answer
		ErrorLog:                     slog.NewLogLogger(a.log.Handler(), slog.LevelDebug),
		ConnState: func(c net.Conn, st http.ConnState) {
			if sc, ok := c.(*streamConn); ok {
				sc.state(st)
			}
		},
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if sc, ok := c.(*streamConn); ok {
				return context.WithValue(ctx, streamKey{}, sc)
			}
			return ctx
		},
	}
}

type streamKey struct{}

// serveStreams serves the streams ln accepts until it fails; held counts
// those that hold up a drain, open those accepted and not closed. Every
// stream's goroutine is counted in the agent's WaitGroup until it ends.
func (a *Agent) serveStreams(ln net.Listener, held *mux.Tracker, open *atomic.Int64) {
	srv := a.newStreamServer()
	srv.Serve(&streamListener{Listener: ln, a: a, held: held, open: open})
	srv.Close() // the session is over: so are its streams
}

// streamListener counts each stream it accepts from ln, the session's, in
// the agent's WaitGroup and the drain's tracker.
type streamListener struct {
	net.Listener
	a    *Agent
	held *mux.Tracker
	open *atomic.Int64

	addrs         sync.Once
	local, remote net.Addr // the session's, formatted once
}

func (l *streamListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.a.wg.Add(1) // while serveStreams holds one: never from zero
	l.held.Add()
	l.open.Add(1) // after held: a drain that sees it open sees it held
	l.addrs.Do(func() { l.local, l.remote = fixAddr(c.LocalAddr()), fixAddr(c.RemoteAddr()) })
	sc := &streamConn{Conn: c, a: l.a, held: l.held, open: l.open, holding: true, local: l.local, remote: l.remote}
	sc.waiting.Store(true)
	time.AfterFunc(newStreamGrace, sc.unused)
	return sc, nil
}

// newStreamGrace is how long a new stream holds up the drain before its
// first byte: the edge sends its request right behind the stream's
// opening, which a takeover's notice may overtake. One that stays silent
// (the edge's pool opened one it did not need) holds up nothing after it,
// rather than until its wait for a request head (DialTimeout) ends.
const newStreamGrace = time.Second

// unused lets a new stream that has read nothing go from the drain's count.
func (c *streamConn) unused() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.waiting.Load() && c.holding && !c.read {
		c.held.Done()
		c.holding = false
	}
}

// fixedAddr is an address formatted once: every stream of a session has
// its session's addresses, which the server would format for each stream.
type fixedAddr struct{ network, s string }

func fixAddr(a net.Addr) net.Addr {
	if a == nil {
		return nil
	}
	return &fixedAddr{a.Network(), a.String()}
}

func (a *fixedAddr) Network() string { return a.network }
func (a *fixedAddr) String() string  { return a.s }

// streamConn is one stream as the server sees it.
type streamConn struct {
	net.Conn
	a             *Agent
	held          *mux.Tracker
	open          *atomic.Int64 // the session's streams accepted and not closed
	closed        atomic.Bool
	local, remote net.Addr
	written       atomic.Int64 // bytes written to the edge
	// waiting: new or idle, so that its next byte starts an exchange,
	// which holds up the drain from then on. Written under mu.
	waiting atomic.Bool

	mu      sync.Mutex
	holding bool // counted in held
	read    bool // a byte was read: not new any more
	ended   bool // its WaitGroup count is given back
}

// Read holds up the drain from an exchange's first byte on an idle
// stream (a new one holds it from its accept, for newStreamGrace at
// least): a stream that waits for its next request holds up nothing.
func (c *streamConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.waiting.Load() {
		c.mu.Lock()
		if c.waiting.Load() && !c.holding && !c.ended {
			c.held.Add()
			c.holding = true
		}
		c.waiting.Store(false)
		c.read = true
		c.mu.Unlock()
	}
	return n, err
}

// Close takes the stream from the session's open ones, once.
func (c *streamConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.open.Add(-1)
	}
	return c.Conn.Close()
}

func (c *streamConn) LocalAddr() net.Addr  { return c.local }
func (c *streamConn) RemoteAddr() net.Addr { return c.remote }

func (c *streamConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.written.Add(int64(n))
	return n, err
}

// state follows the server's view of the stream: an exchange running holds
// up the drain (from its first byte, Read), and so does a new stream
// (from its accept, within newStreamGrace: unused); an idle stream, an
// upgraded connection or a closed stream does not. A closed or hijacked
// stream's goroutine is done with it.
func (c *streamConn) state(st http.ConnState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st == http.StateNew {
		c.waiting.Store(true)
		return
	}
	hold := st == http.StateActive
	switch {
	case hold && !c.holding && !c.ended:
		c.held.Add()
	case !hold && c.holding:
		c.held.Done()
	}
	c.holding = hold && !c.ended
	c.waiting.Store(st == http.StateIdle)
	if (st == http.StateClosed || st == http.StateHijacked) && !c.ended {
		c.ended = true
		c.a.wg.Done()
	}
}
