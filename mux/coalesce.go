package mux

import (
	"encoding/binary"
	"net"
	"sync"
	"time"
)

// Write coalescing. yamux's send loop writes each frame to the connection
// as it comes: a 12-byte header, then its body, each a TLS record and a
// syscall of its own. Under load that is most of an agent's CPU time. A
// coalescing connection appends the writes to a buffer that one flusher
// goroutine writes out whole, so frames queued while a write is under way
// leave together, and a data header always leaves with its body.

const (
	// maxCoalesce bounds the buffered bytes; a write beyond it waits for
	// the flusher, so a slow peer still pushes back on yamux.
	maxCoalesce = 256 << 10
	// closeFlushTimeout bounds how long Close spends writing out what is
	// buffered before it closes the connection anyway.
	closeFlushTimeout = time.Second
	// yamux's frame header: version, type, flags, stream id, length.
	yamuxHeaderSize = 12
	yamuxTypeData   = 0
)

var coalesceBufs = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

// Coalesce wraps the connection given to yamux.Client or yamux.Server so
// that frames leave in as few writes as possible. Writes return once
// buffered; a write error is returned by the writes after it. The flusher
// goroutine runs only while there is something to write, so an idle session
// holds neither it nor a buffer. Close waits for a flush under way (for at
// most a second) and closes c.
func Coalesce(c net.Conn) net.Conn {
	cc := &coalescedConn{Conn: c}
	cc.cond.L = &cc.mu
	return cc
}

type coalescedConn struct {
	net.Conn

	mu       sync.Mutex
	cond     sync.Cond // signals writers waiting for room, and Close
	buf      *[]byte   // buffered writes; nil when empty
	err      error     // first write error, or net.ErrClosed after Close
	flushing bool      // a flusher goroutine is running
	closing  bool
	closeErr error
	once     sync.Once
}

func (c *coalescedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.err == nil && !c.closing && c.buf != nil && len(*c.buf)+len(p) > maxCoalesce {
		c.startFlushLocked() // a lone header may not have started one
		c.cond.Wait()
	}
	switch {
	case c.err != nil:
		return 0, c.err
	case c.closing:
		return 0, net.ErrClosed
	}
	if c.buf == nil {
		c.buf = coalesceBufs.Get().(*[]byte)
	}
	*c.buf = append(*c.buf, p...)
	// yamux writes a data frame's body right after its header: flush only
	// once the body is in too.
	if !isDataHeader(p) {
		c.startFlushLocked()
	}
	return len(p), nil
}

func isDataHeader(p []byte) bool {
	return len(p) == yamuxHeaderSize && p[1] == yamuxTypeData && binary.BigEndian.Uint32(p[8:]) > 0
}

func (c *coalescedConn) startFlushLocked() {
	if !c.flushing {
		c.flushing = true
		go c.flushLoop()
	}
}

// flushLoop writes out the buffer until it is empty, Close or a write error.
func (c *coalescedConn) flushLoop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.cond.Broadcast()
	for c.buf != nil && c.err == nil {
		b := c.buf
		c.buf = nil
		c.mu.Unlock()
		_, err := c.Conn.Write(*b)
		*b = (*b)[:0]
		if cap(*b) <= maxCoalesce+64<<10 {
			coalesceBufs.Put(b)
		}
		c.mu.Lock()
		if err != nil && c.err == nil {
			c.err = err
		}
		c.cond.Broadcast()
	}
	c.flushing = false
}

// Close lets a flush under way finish, so that frames yamux wrote before it
// closed still leave, then closes the connection. A flush blocked for
// closeFlushTimeout is broken off. Close is idempotent.
func (c *coalescedConn) Close() error {
	c.once.Do(func() {
		c.mu.Lock()
		c.closing = true
		if c.flushing {
			t := time.AfterFunc(closeFlushTimeout, func() { c.Conn.Close() })
			for c.flushing {
				c.cond.Wait()
			}
			t.Stop()
		}
		c.err = net.ErrClosed
		c.buf = nil // at most a data header whose body never came
		c.mu.Unlock()
		c.closeErr = c.Conn.Close()
	})
	return c.closeErr
}
