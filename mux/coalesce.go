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
// goroutine writes out, so frames queued while a write is under way leave
// together, and a data header always leaves with its body.
//
// The connection follows the frame stream it is given (frames.go): it
// always knows whether the next byte is part of a header or of a data
// frame's body, so no decision rests on the bytes of a body.
//
// Frames wait in two queues. Large data frames, and every frame of a
// stream that has one waiting, are bulk; all others (control frames, small
// data frames: requests, most responses, an upgraded connection's
// messages) go first, ahead of any bulk waiting, so that a small response
// is not queued behind a download's backlog. A stream's frames keep their
// order. Each write takes all the first frames and a chunk of bulk, sized
// so that a write takes about chunkTime: over a slow link, a frame that
// comes while one is written waits for little more than a chunk. The
// socket beneath holds no more unsent bytes than a chunk or unsentTime at
// the rate the kernel reckons it sends, whichever is more.
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
	// bulkFrame is the body length from which a data frame is bulk.
	bulkFrame = 16 << 10
	// chunkTime is how long a write should take; minChunk bounds the bulk
	// one write takes from below.
	chunkTime = 10 * time.Millisecond
	minChunk  = 16 << 10
	// unsentTime is how long the socket's unsent bytes may take to leave
	// at the rate the kernel reckons it sends; rateSample bounds how often
	// that rate is read.
	unsentTime = 20 * time.Millisecond
	rateSample = 10 * time.Millisecond
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
	// UnsentLimit bounds the TCP_NOTSENT_LOWAT of the TCP socket beneath,
	// in bytes: how much written data the kernel holds that it has not yet
	// sent. Frames wait above it, where a small response overtakes a bulk
	// transfer's queue, instead of behind megabytes in the socket. The
	// connection sets the socket's limit to unsentTime (20 ms) at the
	// send rate the kernel reports for it (TCP_INFO's pacing rate or
	// delivery rate, the larger; read at most every rateSample after a
	// bulk write), and to no less than its chunk of bulk or minChunk,
	// within UnsentLimit. A limit of a few milliseconds of the link (the
	// chunk alone) left the socket empty whenever the flusher woke late
	// on a busy machine, and cost a third of the throughput over a lossy
	// link (BENCHMARKS.md); 20 ms is what a small response waits behind a
	// download in the socket. Zero means DefaultUnsentLimit; negative
	// leaves the socket as it is.
	UnsentLimit int
	// SendBuffer, when positive, is how many bytes the TCP socket beneath
	// should be able to hold written and not yet acknowledged: a stream
	// window's worth, so that the socket does not cap what one stream has
	// in flight below its window. Over a lossy link the kernel keeps each
	// byte after a lost segment until the retransmission is acknowledged,
	// a round trip or more, and its autotuned buffer (at most
	// net.ipv4.tcp_wmem's maximum, 4 MiB by default) then caps the link
	// below what the window allows. The socket's SO_SNDBUF is set only
	// where that gives more than autotuning can; the kernel caps it at
	// net.core.wmem_max. It bounds kernel memory only: what it holds is in
	// flight, or unsent within UnsentLimit.
	SendBuffer int
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
	cc := newCoalesced(c, cfg, holdControl)
	if tc := tcpUnder(c); tc != nil && cfg.SendBuffer > 0 {
		if n := sendBufferFor(cfg.SendBuffer); n > 0 {
			tc.SetWriteBuffer(n)
		}
	}
	if cfg.UnsentLimit > 0 {
		cc.tcp = tcpUnder(c)
		cc.limitUnsentLocked()
	}
	return cc
}

func newCoalesced(c net.Conn, cfg CoalesceConfig, hold time.Duration) *coalescedConn {
	cc := &coalescedConn{Conn: c, batched: batchedUnder(c), cfg: cfg, hold: hold, chunk: maxCoalesce, queued: map[uint32]int{}}
	cc.cond.L = &cc.mu
	return cc
}

type coalescedConn struct {
	net.Conn
	batched *batchedConn // under Conn, a TLS connection; or nil
	cfg     CoalesceConfig
	hold    time.Duration // holdControl; tests lengthen it

	readDone atomic.Bool // a read returned an error: nothing more will arrive

	tcp     *net.TCPConn // the socket whose unsent bytes are limited; or nil
	unsent  int          // its TCP_NOTSENT_LOWAT as last set
	rate    int          // its send rate, bytes per second, as last reckoned
	sampled time.Time    // when rate was last read

	mu       sync.Mutex
	cond     sync.Cond      // signals writers waiting for room, and Close
	first    *[]byte        // frames that leave first; nil when empty
	bulk     *[]byte        // bulk frames; nil when empty
	ends     []bulkEnd      // where each whole frame in bulk ends
	queued   map[uint32]int // whole frames in bulk, by stream
	frames   frames         // where the frame stream written so far stands
	chunk    int            // the most bulk one write takes; adapts to the link
	urgent   bool           // a frame waits that must leave now
	holding  bool           // first holds a held frame
	err      error          // first write error, or net.ErrClosed after Close
	flushing bool           // a flusher goroutine is running
	waiting  int            // writers waiting for room
	timer    *time.Timer
	armed    bool // timer will fire
	closing  bool
	closeErr error
	once     sync.Once
}

// bulkEnd is where a whole frame of a stream ends in the bulk queue.
type bulkEnd struct {
	end    int
	stream uint32
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
	for c.err == nil && !c.closing && c.flushableLocked() > 0 && c.queuedLocked()+len(p) > maxCoalesce {
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
	switch urgent, held := c.appendFramesLocked(p); {
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

// appendFramesLocked follows p through the frame stream and queues each
// frame's bytes, a header once it is whole. It reports what the frames p
// completed ask for: urgent, one must leave now; held, one may wait.
func (c *coalescedConn) appendFramesLocked(p []byte) (urgent, held bool) {
	f := &c.frames
	for len(p) > 0 {
		body := f.body > 0
		n, header, done, h := f.step(p)
		switch {
		case body:
			c.appendLocked(f.bulk, p[:n])
		case header:
			f.bulk = c.isBulkLocked()
			c.appendLocked(f.bulk, f.hdr[:])
		}
		p = p[n:]
		if !done {
			continue
		}
		if f.bulk {
			c.ends = append(c.ends, bulkEnd{end: len(*c.bulk), stream: f.stream()})
			c.queued[f.stream()]++
		}
		urgent, held = urgent || !h, held || h
	}
	return urgent, held
}

// isBulkLocked decides the queue of the frame whose header is whole: bulk
// for a large data frame, and for any frame of a stream with frames in
// bulk, which must not overtake them.
func (c *coalescedConn) isBulkLocked() bool {
	id := c.frames.stream()
	if id == 0 {
		return false // session frames: ping, go-away
	}
	return c.queued[id] > 0 || c.frames.hdr[1] == yamuxTypeData && c.frames.length() >= bulkFrame
}

func (c *coalescedConn) queuedLocked() int {
	n := 0
	for _, b := range []*[]byte{c.first, c.bulk} {
		if b != nil {
			n += len(*b)
		}
	}
	return n
}

// flushableLocked is how many buffered bytes a flush could write: all but
// a header still waiting for its body.
func (c *coalescedConn) flushableLocked() int {
	n := c.queuedLocked()
	if c.frames.lone() {
		n -= yamuxHeaderSize
	}
	return n
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

// flushLoop writes out the queues until nothing urgent is left, Close or
// a write error. Writers may fill the queues while one write is under way.
func (c *coalescedConn) flushLoop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.cond.Broadcast()
	for c.urgent && c.err == nil {
		first, bulk := c.takeFirstLocked(), c.takeBulkLocked()
		c.urgent, c.holding = len(c.ends) > 0, false
		if first == nil && bulk == nil {
			break
		}
		c.cond.Broadcast() // room again
		start := time.Now()
		sample := bulk != nil && c.tcp != nil && start.Sub(c.sampled) >= rateSample
		c.mu.Unlock()
		err := c.write(first, bulk)
		d := time.Since(start)
		putBuf(first)
		putBuf(bulk)
		rate := 0
		if sample {
			rate = sendRate(c.tcp)
		}
		c.mu.Lock()
		if err != nil && c.err == nil {
			c.err = err
		}
		if sample {
			c.noteRateLocked(start, rate)
		}
		c.adaptLocked(d)
	}
	c.flushing = false
	if c.holding && c.err == nil && !c.closing {
		c.armLocked()
	}
}

// adaptLocked sizes the next writes' chunk of bulk, and the socket's
// unsent limit with it, from how long the last write took: halved when it
// took longer than chunkTime (a slow link, the socket full), doubled when
// it took a quarter of that.
func (c *coalescedConn) adaptLocked(d time.Duration) {
	switch {
	case d > chunkTime:
		c.chunk = max(c.chunk/2, minChunk)
	case d < chunkTime/4:
		c.chunk = min(c.chunk*2, maxCoalesce)
	}
	c.limitUnsentLocked()
}

// noteRateLocked takes the send rate the kernel reckoned at t. A lower
// figure is followed by at most a quarter each sample: one taken while a
// loss was being repaired, or the link was idle, should not starve the
// socket once it can send again.
func (c *coalescedConn) noteRateLocked(t time.Time, rate int) {
	c.sampled = t
	c.rate = max(rate, c.rate*3/4)
}

// limitUnsentLocked sets the socket's unsent limit to unsentTime at the
// send rate, or the chunk if more, within the configured bound, when that
// changed it.
func (c *coalescedConn) limitUnsentLocked() {
	n := max(c.chunk, int(float64(c.rate)*unsentTime.Seconds()))
	if n = min(n, c.cfg.UnsentLimit); c.tcp != nil && n != c.unsent {
		setUnsent(c.tcp, n)
		c.unsent = n
	}
}

// takeFirstLocked takes the first queue, but a lone header, which stays
// behind to leave with its body.
func (c *coalescedConn) takeFirstLocked() *[]byte {
	if c.first == nil {
		return nil
	}
	return c.splitLocked(false, len(*c.first)-c.loneLocked(false))
}

// takeBulkLocked takes whole bulk frames up to the chunk, and at least
// one; or, while the first frame is still coming, what there is of it but
// a lone header.
func (c *coalescedConn) takeBulkLocked() *[]byte {
	if c.bulk == nil {
		return nil
	}
	n, k := 0, 0
	for k < len(c.ends) && (k == 0 || c.ends[k].end <= c.chunk) {
		n = c.ends[k].end
		k++
	}
	if k == 0 {
		n = len(*c.bulk) - c.loneLocked(true)
	}
	for _, e := range c.ends[:k] {
		if c.queued[e.stream]--; c.queued[e.stream] == 0 {
			delete(c.queued, e.stream)
		}
	}
	c.ends = c.ends[:copy(c.ends, c.ends[k:])]
	for i := range c.ends {
		c.ends[i].end -= n
	}
	return c.splitLocked(true, n)
}

// loneLocked is the length of a lone header at the end of the bulk queue
// (bulk) or the first one.
func (c *coalescedConn) loneLocked(bulk bool) int {
	if c.frames.lone() && c.frames.bulk == bulk {
		return yamuxHeaderSize
	}
	return 0
}

// splitLocked takes the first n bytes of a queue (nil if none); the rest
// moves to a buffer of its own.
func (c *coalescedConn) splitLocked(bulk bool, n int) *[]byte {
	q := &c.first
	if bulk {
		q = &c.bulk
	}
	if n <= 0 {
		return nil
	}
	b := *q
	*q = nil
	if n < len(*b) {
		c.appendLocked(bulk, (*b)[n:])
		*b = (*b)[:n]
	}
	return b
}

// write writes the first frames, then the bulk, within the write timeout;
// their TLS records in one write if the socket is batched.
func (c *coalescedConn) write(bufs ...*[]byte) error {
	c.Conn.SetWriteDeadline(time.Now().Add(c.cfg.WriteTimeout))
	if c.batched != nil {
		c.batched.cork()
	}
	var err error
	for _, b := range bufs {
		if b != nil && err == nil {
			_, err = c.Conn.Write(*b)
		}
	}
	if c.batched != nil {
		if uerr := c.batched.uncork(); err == nil {
			err = uerr
		}
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
		putBuf(c.first) // at most a header whose body never came
		putBuf(c.bulk)
		c.first, c.bulk = nil, nil
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

// appendLocked appends p to a queue (bulk, or the first one), moving to
// the next buffer size up when the buffer is full.
func (c *coalescedConn) appendLocked(bulk bool, p []byte) {
	q := &c.first
	if bulk {
		q = &c.bulk
	}
	need := len(p)
	if *q != nil {
		need += len(**q)
	}
	if *q == nil || need > cap(**q) {
		var next *[]byte
		switch {
		case need <= smallCoalesce:
			next = smallBufs.Get().(*[]byte)
		case need <= mediumCoalesce:
			next = mediumBufs.Get().(*[]byte)
		default:
			next = largeBufs.Get().(*[]byte)
		}
		if *q != nil {
			*next = append(*next, **q...)
			putBuf(*q)
		}
		*q = next
	}
	**q = append(**q, p...)
}

// putBuf returns b (if any) to its pool; one grown past maxCoalesce (a
// frame larger than that) is left to the collector.
func putBuf(b *[]byte) {
	if b == nil {
		return
	}
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
