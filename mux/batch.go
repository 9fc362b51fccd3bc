package mux

import (
	"crypto/tls"
	"errors"
	"net"
	"sync"
)

// Batching under TLS. crypto/tls writes each record (at most 16 KiB of
// data) with a write of its own and reads about one record per read, so a
// transfer through a session costs two syscalls per 16 KiB on each side.
// A batched connection sits between the TLS connection and the socket:
// while Coalesce writes one buffer through TLS, the records gather and
// leave in one write; and while data streams in, one read takes as much as
// the socket holds (up to batchSize) for TLS to read record by record.
// Idle, it holds no buffer.

// batchSize bounds one batched read and the records gathered for one write.
const batchSize = 256 << 10

// Room for the TLS overhead of a full coalesced buffer too.
var batchBufs = sync.Pool{New: func() any { b := make([]byte, batchSize, batchSize+16<<10); return &b }}

// corkSmall is the buffer corked writes gather in first: room for the
// records of a small response or a few frames. Most corked writes are a
// few hundred bytes, and a busy edge corks many connections at once; the
// records move to a batch buffer only when they outgrow it.
const corkSmall = 32 << 10

var corkBufs = sync.Pool{New: func() any { b := make([]byte, 0, corkSmall); return &b }}

// Batched wraps the socket of a session's TLS connection:
// tls.Client(Batched(tcp), cfg) or tls.Server(Batched(tcp), cfg). Coalesce,
// given that TLS connection, gathers the records of each buffer it writes.
func Batched(c net.Conn) net.Conn { return &batchedConn{Conn: c} }

type batchedConn struct {
	net.Conn

	// Read side, used by one reader at a time (TLS reads under its lock).
	rbuf      *[]byte // unread bytes are (*rbuf)[r:w]; nil when empty
	r, w      int
	streaming bool // the last read filled what it was given
	// While peeking (Peek), what is read is kept in peeked; replay is
	// what EndPeek gave back, read before anything else.
	peeking        bool
	peeked, replay []byte

	// Write side: mu orders corked buffers and passing writes.
	mu     sync.Mutex
	corked bool
	wbuf   *[]byte
}

func (c *batchedConn) Read(p []byte) (int, error) {
	if len(c.replay) > 0 {
		n := copy(p, c.replay)
		c.replay = c.replay[n:]
		return n, nil
	}
	n, err := c.read(p)
	if c.peeking {
		if len(c.peeked)+n > maxPeek {
			return 0, ErrPeekTooLarge
		}
		c.peeked = append(c.peeked, p[:n]...)
	}
	return n, err
}

func (c *batchedConn) read(p []byte) (int, error) {
	if c.rbuf != nil {
		n := copy(p, (*c.rbuf)[c.r:c.w])
		c.r += n
		if c.r == c.w {
			c.releaseRead()
		}
		return n, nil
	}
	if !c.streaming || len(p) >= batchSize {
		// Idle or a large read: straight into p, holding no buffer
		// while the read waits.
		n, err := c.Conn.Read(p)
		c.streaming = n > 0 && n == len(p)
		return n, err
	}
	b := batchBufs.Get().(*[]byte)
	n, err := c.Conn.Read(*b)
	c.streaming = n >= len(*b)/4
	if n == 0 {
		batchBufs.Put(b)
		return 0, err
	}
	// An error comes again from the next read of the socket, after
	// what arrived before it.
	m := copy(p, (*b)[:n])
	if m < n {
		c.rbuf, c.r, c.w = b, m, n
	} else {
		batchBufs.Put(b)
	}
	return m, nil
}

func (c *batchedConn) releaseRead() {
	batchBufs.Put(c.rbuf)
	c.rbuf, c.r, c.w = nil, 0, 0
}

func (c *batchedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.peeking {
		return len(p), nil
	}
	if c.corked {
		c.gather(p)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// gather appends p to the corked writes, in a small buffer until they
// outgrow it, then in a batch buffer.
func (c *batchedConn) gather(p []byte) {
	switch {
	case c.wbuf == nil && len(p) <= corkSmall:
		c.wbuf = corkBufs.Get().(*[]byte)
	case c.wbuf == nil:
		c.wbuf = batchBufs.Get().(*[]byte)
		*c.wbuf = (*c.wbuf)[:0]
	case cap(*c.wbuf) == corkSmall && len(*c.wbuf)+len(p) > corkSmall:
		large := batchBufs.Get().(*[]byte)
		*large = append((*large)[:0], *c.wbuf...)
		putCorked(c.wbuf)
		c.wbuf = large
	}
	*c.wbuf = append(*c.wbuf, p...)
}

// putCorked returns a buffer of corked writes to its pool.
func putCorked(b *[]byte) {
	switch {
	case cap(*b) == corkSmall:
		*b = (*b)[:0]
		corkBufs.Put(b)
	case cap(*b) <= 2*batchSize:
		*b = (*b)[:batchSize]
		batchBufs.Put(b)
	}
}

// cork starts gathering writes.
func (c *batchedConn) cork() {
	c.mu.Lock()
	c.corked = true
	c.mu.Unlock()
}

// uncork writes what was gathered since cork and passes writes through
// again.
func (c *batchedConn) uncork() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.corked = false
	b := c.wbuf
	c.wbuf = nil
	if b == nil {
		return nil
	}
	_, err := c.Conn.Write(*b)
	putCorked(b)
	return err
}

// batchedUnder returns the batched connection under c, a TLS connection,
// or nil.
func batchedUnder(c net.Conn) *batchedConn {
	tc, ok := c.(*tls.Conn)
	if !ok {
		return nil
	}
	bc, _ := tc.NetConn().(*batchedConn)
	return bc
}

// maxPeek bounds what a peek keeps: a ClientHello is at most 64 KiB.
const maxPeek = 128 << 10

// ErrPeekTooLarge: a peeked connection read more than a ClientHello.
var ErrPeekTooLarge = errors.New("mux: more read while peeking than a TLS ClientHello")

// Peek starts keeping what c, a batched connection, reads, and dropping
// what is written to it, so that its reader (crypto/tls reading a
// ClientHello) can give the connection up untouched: EndPeek. It reports
// whether c is a batched connection. Not concurrently with c's reads.
func Peek(c net.Conn) bool {
	bc, ok := c.(*batchedConn)
	if ok {
		bc.mu.Lock()
		bc.peeking = true
		bc.mu.Unlock()
	}
	return ok
}

// EndPeek ends Peek; with replay, c's next reads return again what was
// read while peeking.
func EndPeek(c net.Conn, replay bool) {
	bc, ok := c.(*batchedConn)
	if !ok {
		return
	}
	bc.mu.Lock()
	bc.peeking = false
	bc.mu.Unlock()
	if replay {
		bc.replay = bc.peeked
	}
	bc.peeked = nil
}

// BatchedListener wraps a listener whose connections carry sessions:
// tls.NewListener(BatchedListener(ln), cfg).
func BatchedListener(ln net.Listener) net.Listener { return batchedListener{ln} }

type batchedListener struct{ net.Listener }

func (l batchedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return Batched(c), nil
}

// Cork gathers the TLS records written to c, a TLS connection over a
// Batched socket, until Uncork on what it returns writes them in one
// syscall. It returns nil for any other connection. Only the connection's
// one writer may cork it.
func Cork(c net.Conn) Uncorker {
	bc := batchedUnder(c)
	if bc == nil {
		return nil
	}
	bc.cork()
	return bc
}

// Uncorker ends a Cork.
type Uncorker interface{ Uncork() error }

// Uncork writes what was gathered since Cork.
func (c *batchedConn) Uncork() error { return c.uncork() }
