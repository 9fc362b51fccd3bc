package mux

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Write coalescing. yamux's send loop writes each frame to the connection
// as it comes: a 12-byte header, then its body, each a TLS record and a
// syscall of its own. Under load that is most of an agent's CPU time. A
// coalescing connection appends the writes to a buffer that one flusher
// goroutine writes out whole, so frames queued while a write is under way
// leave together, and a data header always leaves with its body.
//
// The connection follows the frame stream it is given (frames.go): it
// always knows whether the next byte is part of a header, of a data
// frame's body, or starts a frame, so no decision rests on the bytes of a
// body. A frame that is complete leaves at once, except the frames that
// open, accept and close a stream (window updates with SYN, ACK or FIN):
// those are held back for up to holdControl, since the request or response
// they belong to, or the next exchange, nearly always follows within it,
// and one write then carries both. Sent alone, each would cost a write
// here and a wake-up of the peer, on the path of every request.

const (
	// maxCoalesce bounds the buffered bytes; a write beyond it waits for
	// the flusher, so a slow peer still pushes back on yamux.
	maxCoalesce = 256 << 10
	// holdControl bounds how long a held frame waits for company.
	holdControl = time.Millisecond
	// closeFlushTimeout bounds how long Close spends writing out what is
	// buffered before it closes the connection anyway.
	closeFlushTimeout = time.Second
)

// CoalesceConfig tunes a coalescing connection.
type CoalesceConfig struct {
	// WriteTimeout bounds each write of buffered frames to the connection.
	// A write still blocked after it fails, and so does every write after
	// it, so a peer that stops reading ends the session as yamux's
	// ConnectionWriteTimeout would without the buffer between them. Zero
	// means DefaultConfig's ConnectionWriteTimeout (10s).
	WriteTimeout time.Duration
	// Linger, when positive, makes Close of a connection that has met no
	// error end its writing side (under TLS a close_notify behind
	// everything written) and wait up to Linger for the peer to close its
	// side, reading and discarding what still arrives. Closing a TCP
	// connection with unread bytes sends a reset, which throws away what
	// the network had not yet carried: the tail of the last response. Zero
	// closes at once.
	Linger time.Duration
	// UnsentLimit is the TCP_NOTSENT_LOWAT of the TCP socket beneath, in
	// bytes: how much written data the kernel holds that it has not yet
	// sent. Frames wait above it, where a small response overtakes a bulk
	// transfer's queue, instead of behind megabytes in the socket. Zero
	// means DefaultUnsentLimit; negative leaves the socket as it is.
	UnsentLimit int
}

// Coalesce wraps the connection given to yamux.Client or yamux.Server so
// that frames leave in as few writes as possible, with CoalesceConfig's
// defaults. Writes return once buffered; a write error is returned by the
// writes after it. The flusher goroutine runs only while there is
// something to write, so an idle session holds neither it nor a buffer.
// Close writes out what is buffered (for at most a second) and closes c.
func Coalesce(c net.Conn) net.Conn { return CoalesceWith(c, CoalesceConfig{}) }

// CoalesceWith is Coalesce with cfg.
func CoalesceWith(c net.Conn, cfg CoalesceConfig) net.Conn {
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = DefaultConfig().ConnectionWriteTimeout
	}
	if cfg.UnsentLimit == 0 {
		cfg.UnsentLimit = DefaultUnsentLimit
	}
	if cfg.UnsentLimit > 0 {
		limitUnsent(c, cfg.UnsentLimit)
	}
	return newCoalesced(c, cfg, holdControl)
}

func newCoalesced(c net.Conn, cfg CoalesceConfig, hold time.Duration) *coalescedConn {
	cc := &coalescedConn{Conn: c, batched: batchedUnder(c), cfg: cfg, hold: hold}
	cc.cond.L = &cc.mu
	return cc
}

type coalescedConn struct {
	net.Conn
	batched *batchedConn // under Conn, a TLS connection; or nil
	cfg     CoalesceConfig
	hold    time.Duration // holdControl; tests lengthen it

	readDone atomic.Bool // a read returned an error: nothing more will arrive

	mu       sync.Mutex
	cond     sync.Cond // signals writers waiting for room, and Close
	buf      *[]byte   // buffered writes; nil when empty
	frames   frames    // where the frame stream written so far stands
	urgent   bool      // buf holds a frame that must leave now
	holding  bool      // buf holds a held frame
	err      error     // first write error, or net.ErrClosed after Close
	flushing bool      // a flusher goroutine is running
	waiting  int       // writers waiting for room
	timer    *time.Timer
	armed    bool // timer will fire
	closing  bool
	closeErr error
	once     sync.Once
}

func (c *coalescedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.readDone.Store(true)
	}
	return n, err
}

func (c *coalescedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.err == nil && !c.closing && c.flushableLocked() > 0 && len(*c.buf)+len(p) > maxCoalesce {
		c.urgent = true // held frames may not have started a flush
		c.startFlushLocked()
		c.waiting++
		c.cond.Wait()
		c.waiting--
	}
	switch {
	case c.err != nil:
		return 0, c.err
	case c.closing:
		return 0, net.ErrClosed
	}
	c.appendLocked(p)
	switch urgent, held := c.frames.scan(p); {
	case urgent:
		c.urgent = true
		c.startFlushLocked()
	case held:
		c.holding = true
		if !c.urgent {
			c.armLocked()
		}
	}
	return len(p), nil
}

// flushableLocked is how many buffered bytes a flush would write: all but
// a header still waiting for its body.
func (c *coalescedConn) flushableLocked() int {
	if c.buf == nil {
		return 0
	}
	return len(*c.buf) - c.frames.pending()
}

func (c *coalescedConn) startFlushLocked() {
	if !c.flushing {
		c.flushing = true
		go c.flushLoop()
	}
}

// armLocked makes sure held frames leave within c.hold.
func (c *coalescedConn) armLocked() {
	if c.armed || c.flushing {
		return // the flusher arms it on its way out if need be
	}
	c.armed = true
	if c.timer == nil {
		c.timer = time.AfterFunc(c.hold, c.release)
		return
	}
	c.timer.Reset(c.hold)
}

// release sends held frames whose time is up.
func (c *coalescedConn) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed = false
	if c.holding && !c.closing {
		c.urgent = true
		c.startFlushLocked()
	}
}

// flushLoop writes out the buffer until nothing urgent is left, Close or a
// write error. Writers may fill the next buffer while one is written.
func (c *coalescedConn) flushLoop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.cond.Broadcast()
	for c.urgent && c.err == nil {
		b := c.takeLocked()
		c.urgent, c.holding = false, false
		if b == nil {
			break
		}
		c.cond.Broadcast() // room again
		c.mu.Unlock()
		err := c.write(*b)
		putBuf(b)
		c.mu.Lock()
		if err != nil && c.err == nil {
			c.err = err
		}
	}
	c.flushing = false
	if c.holding && c.err == nil && !c.closing {
		c.armLocked()
	}
}

// takeLocked takes what a flush writes out of the buffer. A header still
// waiting for its body stays behind, in a buffer of its own, so that it
// leaves with the body.
func (c *coalescedConn) takeLocked() *[]byte {
	n := c.flushableLocked()
	if n <= 0 {
		return nil
	}
	b := c.buf
	c.buf = nil
	if n < len(*b) {
		c.appendLocked((*b)[n:])
		*b = (*b)[:n]
	}
	return b
}

// write writes b within the write timeout, its TLS records in one write if
// the socket is batched.
func (c *coalescedConn) write(b []byte) error {
	c.Conn.SetWriteDeadline(time.Now().Add(c.cfg.WriteTimeout))
	if c.batched == nil {
		_, err := c.Conn.Write(b)
		return err
	}
	c.batched.cork()
	_, err := c.Conn.Write(b)
	if uerr := c.batched.uncork(); err == nil {
		err = uerr
	}
	return err
}

// Close writes out what is buffered, so that frames yamux wrote before it
// closed still leave, lingers if so configured, then closes the
// connection. A flush blocked for closeFlushTimeout is broken off. Close
// is idempotent.
func (c *coalescedConn) Close() error {
	c.once.Do(func() {
		c.mu.Lock()
		c.closing = true
		if c.timer != nil {
			c.timer.Stop()
		}
		c.writeOutLocked()
		clean := c.err == nil
		c.err = net.ErrClosed
		if c.buf != nil {
			putBuf(c.buf) // at most a header whose body never came
			c.buf = nil
		}
		c.mu.Unlock()
		if clean && c.cfg.Linger > 0 {
			c.linger()
		}
		c.closeErr = c.Conn.Close()
	})
	return c.closeErr
}

// linger ends the writing side and reads until the peer closes its side,
// or Linger has passed, so that nothing is left unread when the connection
// closes. A peer that has closed already, or a broken connection, needs no
// wait.
func (c *coalescedConn) linger() {
	if c.readDone.Load() {
		return
	}
	cw, ok := c.Conn.(interface{ CloseWrite() error })
	if !ok {
		return
	}
	// The deadline also bounds the close_notify behind a stalled peer,
	// and ends yamux's own read, which may still be running.
	c.Conn.SetDeadline(time.Now().Add(c.cfg.Linger))
	if cw.CloseWrite() != nil {
		return
	}
	var pool BufferPool
	buf := pool.Get()
	defer pool.Put(buf)
	for {
		if _, err := c.Conn.Read(buf); err != nil {
			return
		}
	}
}

// writeOutLocked sends held frames at once and waits for the flusher to
// write out everything buffered, breaking off a flush blocked for
// closeFlushTimeout. c.mu is held.
func (c *coalescedConn) writeOutLocked() {
	if c.holding {
		c.urgent = true
		c.startFlushLocked()
	}
	if c.flushing {
		t := time.AfterFunc(closeFlushTimeout, c.breakFlush)
		for c.flushing {
			c.cond.Wait()
		}
		t.Stop()
	}
}

// breakFlush ends a flush blocked on a peer that does not read. Under TLS
// it closes the socket: closing the TLS connection would first try to send
// an alert behind the blocked write.
func (c *coalescedConn) breakFlush() {
	if tc, ok := c.Conn.(interface{ NetConn() net.Conn }); ok {
		tc.NetConn().Close()
		return
	}
	c.Conn.Close()
}

// Buffers come in three sizes, so that neither a session sending a few
// frames holds a large one nor one streaming a body grows a small one step
// by step (each step garbage). The middle size holds what a busy session
// queues behind a write, dozens of small responses; without it each such
// queue took a large buffer.
const (
	smallCoalesce  = 8 << 10
	mediumCoalesce = 64 << 10
)

var (
	smallBufs  = sync.Pool{New: func() any { b := make([]byte, 0, smallCoalesce); return &b }}
	mediumBufs = sync.Pool{New: func() any { b := make([]byte, 0, mediumCoalesce); return &b }}
	largeBufs  = sync.Pool{New: func() any { b := make([]byte, 0, maxCoalesce); return &b }}
)

// appendLocked appends p to the buffer, moving to the next size up when
// the buffer is full.
func (c *coalescedConn) appendLocked(p []byte) {
	need := len(p)
	if c.buf != nil {
		need += len(*c.buf)
	}
	if c.buf == nil || need > cap(*c.buf) {
		var next *[]byte
		switch {
		case need <= smallCoalesce:
			next = smallBufs.Get().(*[]byte)
		case need <= mediumCoalesce:
			next = mediumBufs.Get().(*[]byte)
		default:
			next = largeBufs.Get().(*[]byte)
		}
		if c.buf != nil {
			*next = append(*next, *c.buf...)
			putBuf(c.buf)
		}
		c.buf = next
	}
	*c.buf = append(*c.buf, p...)
}

// putBuf returns b to its pool; one grown past maxCoalesce (a frame larger
// than that) is left to the collector.
func putBuf(b *[]byte) {
	*b = (*b)[:0]
	switch cap(*b) {
	case smallCoalesce:
		smallBufs.Put(b)
	case mediumCoalesce:
		mediumBufs.Put(b)
	case maxCoalesce:
		largeBufs.Put(b)
	}
}
