package mux

import (
	"encoding/binary"
	"errors"
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
//
// The frames that open, accept and close a stream (window updates with
// SYN, ACK or FIN) are held back for up to holdControl: the request or
// response they belong to, or the next exchange, nearly always follows
// within it, and one write then carries both. Sent alone, each would cost
// a write here and a wake-up of the peer, on the path of every request.

const (
	// maxCoalesce bounds the buffered bytes; a write beyond it waits for
	// the flusher, so a slow peer still pushes back on yamux.
	maxCoalesce = 256 << 10
	// holdControl bounds how long a held frame waits for company.
	holdControl = time.Millisecond
	// closeFlushTimeout bounds how long Close spends writing out what is
	// buffered before it closes the connection anyway.
	closeFlushTimeout = time.Second
	// yamux's frame header: version, type, flags, stream id, length.
	yamuxHeaderSize       = 12
	yamuxTypeData         = 0
	yamuxTypeWindowUpdate = 1
	yamuxFlagsHeld        = 0x1 | 0x2 | 0x4 // SYN, ACK, FIN
	yamuxFlagRST          = 0x8
)

// Coalesce wraps the connection given to yamux.Client or yamux.Server so
// that frames leave in as few writes as possible. Writes return once
// buffered; a write error is returned by the writes after it. The flusher
// goroutine runs only while there is something to write, so an idle session
// holds neither it nor a buffer. Close writes out what is buffered (for at
// most a second) and closes c.
func Coalesce(c net.Conn) net.Conn {
	cc := &coalescedConn{Conn: c, batched: batchedUnder(c)}
	cc.cond.L = &cc.mu
	return cc
}

type coalescedConn struct {
	net.Conn
	batched *batchedConn // under Conn, a TLS connection; or nil

	mu       sync.Mutex
	cond     sync.Cond // signals writers waiting for room, and Close
	buf      *[]byte   // buffered writes; nil when empty
	urgent   bool      // buf holds a frame that must leave now
	holding  bool      // buf holds a held frame
	err      error     // first write error, or net.ErrClosed after Close
	flushing bool      // a flusher goroutine is running
	timer    *time.Timer
	armed    bool // timer will fire
	closing  bool
	closeErr error
	once     sync.Once
}

func (c *coalescedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.err == nil && !c.closing && c.buf != nil && len(*c.buf)+len(p) > maxCoalesce {
		c.urgent = true // a lone header or held frames may not have started one
		c.startFlushLocked()
		c.cond.Wait()
	}
	switch {
	case c.err != nil:
		return 0, c.err
	case c.closing:
		return 0, net.ErrClosed
	}
	c.appendLocked(p)
	switch {
	case isDataHeader(p):
		// yamux writes a data frame's body right after its header:
		// flush once the body is in too.
	case isHeld(p):
		c.holding = true
		if !c.urgent {
			c.armLocked()
		}
	default:
		c.urgent = true
		c.startFlushLocked()
	}
	return len(p), nil
}

func isDataHeader(p []byte) bool {
	return len(p) == yamuxHeaderSize && p[1] == yamuxTypeData && binary.BigEndian.Uint32(p[8:]) > 0
}

// isHeld reports whether p is a stream's SYN, ACK or FIN window update.
func isHeld(p []byte) bool {
	if len(p) != yamuxHeaderSize || p[1] != yamuxTypeWindowUpdate {
		return false
	}
	flags := binary.BigEndian.Uint16(p[2:])
	return flags&yamuxFlagsHeld != 0 && flags&yamuxFlagRST == 0
}

func (c *coalescedConn) startFlushLocked() {
	if !c.flushing {
		c.flushing = true
		go c.flushLoop()
	}
}

// armLocked makes sure held frames leave within holdControl.
func (c *coalescedConn) armLocked() {
	if c.armed || c.flushing {
		return // the flusher arms it on its way out if need be
	}
	c.armed = true
	if c.timer == nil {
		c.timer = time.AfterFunc(holdControl, c.release)
		return
	}
	c.timer.Reset(holdControl)
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
	for c.buf != nil && c.urgent && c.err == nil {
		b := c.buf
		c.buf, c.urgent, c.holding = nil, false, false
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

// write writes b, its TLS records in one write if the socket is batched.
func (c *coalescedConn) write(b []byte) error {
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
// closed still leave, then closes the connection. A flush blocked for
// closeFlushTimeout is broken off. Close is idempotent.
func (c *coalescedConn) Close() error {
	c.once.Do(func() {
		c.mu.Lock()
		c.closing = true
		if c.timer != nil {
			c.timer.Stop()
		}
		c.writeOutLocked()
		c.err = net.ErrClosed
		c.buf = nil // at most a data header whose body never came
		c.mu.Unlock()
		c.closeErr = c.Conn.Close()
	})
	return c.closeErr
}

// CloseWrite writes out what is buffered, then ends the writing side of
// the connection beneath: under TLS a close_notify alert, which the peer
// reads as the end of the stream once it has read everything before it.
// yamux's Close calls it to linger (yamux.Config.CloseLinger); nothing is
// written after it. A flush blocked for closeFlushTimeout is broken off.
func (c *coalescedConn) CloseWrite() error {
	cw, ok := c.Conn.(interface{ CloseWrite() error })
	if !ok {
		return errors.ErrUnsupported
	}
	c.mu.Lock()
	c.writeOutLocked()
	err := c.err
	c.mu.Unlock()
	if err != nil {
		return err
	}
	return cw.CloseWrite()
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
