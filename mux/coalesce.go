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

var coalesceBufs = sync.Pool{New: func() any { b := make([]byte, 0, 64<<10); return &b }}

// Coalesce wraps the connection given to yamux.Client or yamux.Server so
// that frames leave in as few writes as possible. Writes return once
// buffered; a write error is returned by the writes after it. Close writes
// out what is buffered (for at most a second) and closes c. It starts no
// goroutine before the first write, and none survives Close.
func Coalesce(c net.Conn) net.Conn {
	cc := &coalescedConn{Conn: c, done: make(chan struct{})}
	cc.cond.L = &cc.mu
	return cc
}

type coalescedConn struct {
	net.Conn

	mu       sync.Mutex
	cond     sync.Cond // signals the flusher and writers waiting for room
	buf      *[]byte   // buffered writes; nil when empty
	err      error     // first write error, or net.ErrClosed after Close
	writing  bool      // the flusher is in a write of the connection
	closing  bool
	started  bool
	done     chan struct{} // closed when the flusher has returned
	closeErr error
	once     sync.Once
}

func (c *coalescedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.err == nil && !c.closing && c.buf != nil && len(*c.buf)+len(p) > maxCoalesce {
		c.cond.Broadcast() // the flusher may not have been woken for a lone header
		c.cond.Wait()
	}
	switch {
	case c.err != nil:
		return 0, c.err
	case c.closing:
		return 0, net.ErrClosed
	}
	if !c.started {
		c.started = true
		go c.flushLoop()
	}
	if c.buf == nil {
		c.buf = coalesceBufs.Get().(*[]byte)
	}
	*c.buf = append(*c.buf, p...)
	// yamux writes a data frame's body right after its header: wake the
	// flusher only once the body is in too.
	if !isDataHeader(p) {
		c.cond.Broadcast()
	}
	return len(p), nil
}

func isDataHeader(p []byte) bool {
	return len(p) == yamuxHeaderSize && p[1] == yamuxTypeData && binary.BigEndian.Uint32(p[8:]) > 0
}

// flushLoop writes out the buffer until Close or a write error.
func (c *coalescedConn) flushLoop() {
	defer close(c.done)
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		for c.buf == nil && !c.closing {
			c.cond.Wait()
		}
		if c.buf == nil || c.err != nil {
			return
		}
		b := c.buf
		c.buf = nil
		c.writing = true
		c.mu.Unlock()
		_, err := c.Conn.Write(*b)
		*b = (*b)[:0]
		if cap(*b) <= maxCoalesce+64<<10 {
			coalesceBufs.Put(b)
		}
		c.mu.Lock()
		c.writing = false
		if err != nil && c.err == nil {
			c.err = err
		}
		c.cond.Broadcast()
		if c.err != nil {
			return
		}
	}
}

// Close writes out what is buffered, unless a write is already blocked
// (then it is broken off, as closing a plain connection would), and
// closes the connection. It is idempotent.
func (c *coalescedConn) Close() error {
	c.once.Do(func() {
		c.mu.Lock()
		c.closing = true
		started, writing := c.started, c.writing
		c.cond.Broadcast()
		c.mu.Unlock()
		if started {
			if writing {
				c.Conn.Close()
			}
			t := time.AfterFunc(closeFlushTimeout, func() { c.Conn.Close() })
			<-c.done
			t.Stop()
		}
		c.closeErr = c.Conn.Close()
		c.mu.Lock()
		if c.err == nil {
			c.err = net.ErrClosed
		}
		c.mu.Unlock()
	})
	return c.closeErr
}
