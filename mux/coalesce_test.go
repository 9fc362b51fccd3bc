package mux

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	crand "crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"io"
	"math/big"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

func dataHeader(n int) []byte {
	h := make([]byte, yamuxHeaderSize)
	binary.BigEndian.PutUint32(h[8:], uint32(n))
	return h
}

func TestCoalesceKeepsOrderAndFlushesOnClose(t *testing.T) {
	client, server := tcpPair(t)
	c := Coalesce(client)
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(server)
		got <- b
	}()
	var want bytes.Buffer
	for i := range 300 {
		body := bytes.Repeat([]byte{byte(i)}, 1+i*i*97%(3*maxCoalesce/2))
		for _, p := range [][]byte{dataHeader(len(body)), body, {0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9}} {
			if _, err := c.Write(p); err != nil {
				t.Fatalf("write %d: %v", i, err)
			}
			want.Write(p)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	select {
	case b := <-got:
		if !bytes.Equal(b, want.Bytes()) {
			t.Fatalf("peer read %d bytes, want %d in the order written", len(b), want.Len())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("peer did not see EOF after Close")
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %v, want net.ErrClosed", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
}

// TestCoalesceBufferSizes: the buffer is always the smallest of the three
// sizes that holds what is queued, and keeps every byte in order as it
// moves up.
func TestCoalesceBufferSizes(t *testing.T) {
	c := &coalescedConn{}
	var want []byte
	for i, n := range []int{100, 8000, 100, 30000, 40000, 200, 150000, 100} {
		p := bytes.Repeat([]byte{byte(i + 1)}, n)
		c.appendLocked(false, p)
		want = append(want, p...)
		size := maxCoalesce
		switch {
		case len(want) <= smallCoalesce:
			size = smallCoalesce
		case len(want) <= mediumCoalesce:
			size = mediumCoalesce
		}
		if cap(*c.first) != size {
			t.Fatalf("%d bytes queued in a %d-byte buffer, want %d", len(want), cap(*c.first), size)
		}
	}
	if !bytes.Equal(*c.first, want) {
		t.Fatal("the queued bytes changed as the buffer moved up")
	}
	putBuf(c.first)
}

func TestCoalesceHoldsHeaderForItsBody(t *testing.T) {
	client, server := tcpPair(t)
	c := Coalesce(client)
	if _, err := c.Write(dataHeader(5)); err != nil {
		t.Fatal(err)
	}
	server.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := server.Read(make([]byte, 64)); n != 0 || err == nil {
		t.Fatalf("a lone data header left before its body: %d bytes, %v", n, err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, yamuxHeaderSize+5)
	if _, err := io.ReadFull(server, b); err != nil || string(b[yamuxHeaderSize:]) != "hello" {
		t.Fatalf("frame = %q, %v", b, err)
	}
	c.Close()
}

// TestCoalesceHeaderWaitsBehindAFlush: a header written while an urgent
// frame is queued stays back when the flusher takes the queue, and leaves
// with its body.
func TestCoalesceHeaderWaitsBehindAFlush(t *testing.T) {
	client, server := tcpPair(t)
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: time.Minute}, time.Minute)
	t.Cleanup(func() { c.Close() })
	c.mu.Lock() // no flush may start until both are queued
	ping := frameHeader(2, 0x1, 0, 7)
	c.appendFramesLocked(ping)
	c.urgent = true
	hdr := dataHeader(3)
	c.appendFramesLocked(hdr)
	c.startFlushLocked()
	c.mu.Unlock()
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(ping))
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, ping) {
		t.Fatalf("ping = %x, %v", got, err)
	}
	server.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if n, err := server.Read(make([]byte, 64)); n != 0 || err == nil {
		t.Fatalf("the header left with the ping, before its body: %d bytes, %v", n, err)
	}
	if _, err := c.Write([]byte("abc")); err != nil {
		t.Fatal(err)
	}
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	got = make([]byte, yamuxHeaderSize+3)
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, append(hdr, "abc"...)) {
		t.Fatalf("frame = %x, %v", got, err)
	}
}

// frameHeader is a yamux header of any type.
func frameHeader(typ byte, flags uint16, id, length uint32) []byte {
	h := make([]byte, yamuxHeaderSize)
	h[1] = typ
	binary.BigEndian.PutUint16(h[2:], flags)
	binary.BigEndian.PutUint32(h[4:], id)
	binary.BigEndian.PutUint32(h[8:], length)
	return h
}

// TestCoalesceBodiesLikeHeaders: a data frame's body leaves at once
// whatever it holds. Bodies of 12 bytes shaped like a data header, a
// stream's SYN, ACK or FIN, a plain window update, a ping and a go-away,
// and bodies of every length from 1 to 64, each written as yamux writes
// them (header, then body), reach the peer with nothing written after
// them. Held frames are held for a minute here, so a body taken for one
// would not arrive in time.
func TestCoalesceBodiesLikeHeaders(t *testing.T) {
	client, server := tcpPair(t)
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: time.Minute}, time.Minute)
	t.Cleanup(func() { c.Close() })
	bodies := [][]byte{
		dataHeader(5), dataHeader(1 << 20), frameHeader(yamuxTypeData, 0x1, 3, 9),
		frameHeader(yamuxTypeWindowUpdate, 0x1, 3, 0), frameHeader(yamuxTypeWindowUpdate, 0x2, 4, 1<<18),
		frameHeader(yamuxTypeWindowUpdate, 0x4, 5, 0), frameHeader(yamuxTypeWindowUpdate, 0, 5, 4096),
		frameHeader(2, 0x1, 0, 77), frameHeader(3, 0, 0, 0),
	}
	for n := 1; n <= 64; n++ {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(n + i)
		}
		bodies = append(bodies, b)
	}
	for i, body := range bodies {
		hdr := frameHeader(yamuxTypeData, 0, uint32(i+1), uint32(len(body)))
		for _, p := range [][]byte{hdr, body} {
			if _, err := c.Write(p); err != nil {
				t.Fatal(err)
			}
		}
		server.SetReadDeadline(time.Now().Add(10 * time.Second))
		got := make([]byte, len(hdr)+len(body))
		if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, append(hdr, body...)) {
			t.Fatalf("frame %d (body %x): read %x, %v", i, body, got, err)
		}
	}
}

// TestCoalesceFramesInPieces: the frame stream written in pieces of any
// size arrives unchanged, and once a piece completes a frame that must
// leave, everything before it leaves without another write.
func TestCoalesceFramesInPieces(t *testing.T) {
	client, server := tcpPair(t)
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: time.Minute}, time.Minute)
	t.Cleanup(func() { c.Close() })
	rng := rand.New(rand.NewPCG(3, 4))
	var stream []byte
	var ends []int // where each data frame ends
	for i := range 200 {
		body := make([]byte, rng.IntN(70000))
		for j := range body {
			body[j] = byte(rng.Uint32())
		}
		stream = append(append(stream, frameHeader(yamuxTypeData, 0, uint32(i), uint32(len(body)))...), body...)
		if len(body) == 0 {
			continue // a data frame without a body is a control frame; urgent as well
		}
		ends = append(ends, len(stream))
	}
	sent, read := 0, 0
	for _, end := range ends {
		for sent < end {
			n := min(end-sent, 1+rng.IntN(20000))
			if _, err := c.Write(stream[sent : sent+n]); err != nil {
				t.Fatal(err)
			}
			sent += n
		}
		server.SetReadDeadline(time.Now().Add(10 * time.Second))
		got := make([]byte, end-read)
		if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, stream[read:end]) {
			t.Fatalf("bytes %d to %d: %v, or not the ones written", read, end, err)
		}
		read = end
	}
	if _, err := c.Write(stream[sent:]); err != nil {
		t.Fatal(err)
	}
	c.Close()
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	rest, err := io.ReadAll(server)
	if err != nil || !bytes.Equal(rest, stream[read:]) {
		t.Fatalf("the last %d bytes: %v, or not the ones written", len(stream)-read, err)
	}
}

func TestCoalesceUnderYamux(t *testing.T) {
	client, server := tcpPair(t)
	cs, err := yamux.Client(Coalesce(client), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	ss, err := yamux.Server(Coalesce(server), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	go func() {
		st, err := ss.Accept()
		if err != nil {
			return
		}
		io.Copy(st, st)
		st.Close()
	}()
	st, err := cs.Open()
	if err != nil {
		t.Fatal(err)
	}
	msg := bytes.Repeat([]byte("ngstone "), 1<<17) // 1 MiB: several windows
	defer st.Close()
	go st.Write(msg)
	st.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(st, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo: %v; the bytes differ: %v", err, !bytes.Equal(got, msg))
	}
}

func heldFrame(flags uint16, id uint32) []byte {
	return frameHeader(yamuxTypeWindowUpdate, flags, id, 0)
}

// TestCoalesceHoldsControlFramesBriefly: a stream's SYN, ACK or FIN waits
// for company up to the hold, and leaves at once with the next frame that
// must leave; every other frame leaves at once. The holds here are long, so
// that a frame held by mistake would be late by far more than any load
// could make it.
func TestCoalesceHoldsControlFramesBriefly(t *testing.T) {
	client, server := tcpPair(t)
	const hold = 200 * time.Millisecond
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: time.Minute}, hold)
	t.Cleanup(func() { c.Close() })
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	// A lone ACK leaves after the hold even with nothing after it.
	ack := heldFrame(0x2, 7)
	start := time.Now()
	if _, err := c.Write(ack); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, yamuxHeaderSize)
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, ack) {
		t.Fatalf("held frame: %x, %v", got, err)
	}
	if d := time.Since(start); d < hold {
		t.Errorf("held frame left after %v, before its hold of %v", d, hold)
	}

	c = newCoalesced(client, CoalesceConfig{WriteTimeout: time.Minute}, time.Minute)
	t.Cleanup(func() { c.Close() })
	// A FIN followed by a data frame leaves with it, in order, at once.
	fin, body := heldFrame(0x4, 9), []byte("response")
	for _, p := range [][]byte{fin, dataHeader(len(body)), body} {
		if _, err := c.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	want := append(append(append([]byte{}, fin...), dataHeader(len(body))...), body...)
	got = make([]byte, len(want))
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("frames = %x, %v; want %x", got, err, want)
	}
	// An RST (even with FIN), a plain window update, a ping and a go-away
	// leave at once, each taking a held SYN with it.
	for _, f := range [][]byte{
		heldFrame(0x8, 11), heldFrame(0x8|0x4, 12), frameHeader(yamuxTypeWindowUpdate, 0, 13, 1<<16),
		frameHeader(2, 0x1, 0, 5), frameHeader(2, 0x2, 0, 5), frameHeader(3, 0, 0, 1),
	} {
		syn := heldFrame(0x1, 21)
		for _, p := range [][]byte{syn, f} {
			if _, err := c.Write(p); err != nil {
				t.Fatal(err)
			}
		}
		server.SetReadDeadline(time.Now().Add(10 * time.Second))
		got = make([]byte, 2*yamuxHeaderSize)
		if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, append(syn, f...)) {
			t.Fatalf("frame %x after a SYN: read %x, %v", f, got, err)
		}
	}
}

// TestCoalesceCloseSendsWholeFrames: Close sends what is buffered, held
// frames included, but not a header whose body never came.
func TestCoalesceCloseSendsWholeFrames(t *testing.T) {
	fin := heldFrame(0x4, 3)
	for name, writes := range map[string][][]byte{
		"held FIN":            {fin},
		"FIN and lone header": {fin, dataHeader(100)},
	} {
		t.Run(name, func(t *testing.T) {
			client, server := tcpPair(t)
			c := Coalesce(client)
			for _, p := range writes {
				if _, err := c.Write(p); err != nil {
					t.Fatal(err)
				}
			}
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
			server.SetReadDeadline(time.Now().Add(5 * time.Second))
			b, err := io.ReadAll(server)
			if err != nil || !bytes.Equal(b, fin) {
				t.Fatalf("peer read %x, %v; want the FIN, then EOF", b, err)
			}
		})
	}
}

// TestCoalesceLinger: Close of a lingering connection sends what is
// buffered, held frames included, then ends the writing side under TLS
// (close_notify); it reads and discards what the peer still sends, and
// returns once the peer has closed.
func TestCoalesceLinger(t *testing.T) {
	client, server := tcpPair(t)
	tc, ts := tlsPair(t, Batched(client), Batched(server))
	c := CoalesceWith(ts, CoalesceConfig{Linger: time.Minute})
	t.Cleanup(func() { tc.Close() })
	body := bytes.Repeat([]byte("tail"), 64<<10)
	fin := heldFrame(0x4, 5)
	want := append(append(dataHeader(len(body)), body...), fin...)
	for _, p := range [][]byte{dataHeader(len(body)), body, fin} {
		if _, err := c.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(tc)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("peer read %d of %d bytes (%v), or not the ones written", len(got), len(want), err)
	}
	// The peer has read the end; the closing side still waits, and reads
	// what the peer sends meanwhile.
	if _, err := tc.Write(bytes.Repeat([]byte("late"), 64<<10)); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) before the peer closed", err)
	default:
	}
	tc.Close()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close still lingering 10s after the peer closed")
	}
}

// TestCoalesceLingerBounded: a peer that never closes holds Close for the
// linger, no longer; a peer that closed first holds it not at all.
func TestCoalesceLingerBounded(t *testing.T) {
	client, server := tcpPair(t)
	const linger = 300 * time.Millisecond
	c := CoalesceWith(client, CoalesceConfig{Linger: linger})
	start := time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < linger || d > linger+10*time.Second {
		t.Errorf("Close with a silent peer took %v, want the linger of %v", d, linger)
	}
	server.SetReadDeadline(time.Now().Add(10 * time.Second))
	if b, err := io.ReadAll(server); err != nil || len(b) != 0 {
		t.Errorf("peer read %q, %v; want EOF", b, err)
	}

	client, server = tcpPair(t)
	c = CoalesceWith(client, CoalesceConfig{Linger: time.Minute})
	server.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("read from a closed peer succeeded")
	}
	start = time.Now()
	c.Close()
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Close after the peer closed took %v", d)
	}
}

// TestLingerDeliversTail: the tail of a response written just before the
// session closes arrives whole. The receiver has stopped reading its
// socket, so the tail is still in the kernel's queues when the sender's
// session closes; then the receiver reads it and answers with window
// updates. Without the linger those would reach a closed socket, whose
// kernel answers with a reset and drops what it has not sent yet. Run it
// many times under load: go test -race -count=300 -run TestLingerDeliversTail ./mux
func TestLingerDeliversTail(t *testing.T) {
	client, server := tcpPair(t)
	// The tail waits in the sender's kernel, as behind a slow link.
	server.(*net.TCPConn).SetReadBuffer(64 << 10)
	client.(*net.TCPConn).SetWriteBuffer(4 << 20)
	g := &gate{Conn: server}
	g.cond.L = &g.mu
	tc, ts := tlsPair(t, client, g)
	cfg := yamux.DefaultConfig()
	cfg.LogOutput = io.Discard
	cfg.MaxStreamWindowSize = 1 << 20
	cc := newCoalesced(tc, CoalesceConfig{WriteTimeout: time.Minute, Linger: 10 * time.Second}, holdControl)
	cs, err := yamux.Client(cc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ss, err := yamux.Server(Coalesce(ts), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.shut(false); cs.Close(); ss.Close() })
	w := int(cfg.MaxStreamWindowSize)
	data := make([]byte, 2*w)
	for i := range data {
		data[i] = byte(i % 251)
	}
	st, err := cs.Open()
	if err != nil {
		t.Fatal(err)
	}
	st.SetDeadline(time.Now().Add(20 * time.Second))
	peer, err := ss.Accept() // its ACK opens the stream's window beyond yamux's initial 256 KiB
	if err != nil {
		t.Fatal(err)
	}
	peer.SetDeadline(time.Now().Add(20 * time.Second))
	wrote := make(chan error, 1)
	go func() {
		_, err := st.Write(data[:w])
		wrote <- err
	}()
	got := make([]byte, len(data))
	if _, err := io.ReadFull(peer, got[:w]); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	g.shut(true)
	for i := w; i < len(data); i += 16 << 10 { // frames as the relays write them
		if _, err := st.Write(data[i : i+16<<10]); err != nil { // within the window the reads gave back
			t.Fatal(err)
		}
	}
	st.Close()
	waitFlushed(t, cc)
	closed := make(chan error, 1)
	go func() { closed <- cs.Close() }()
	g.shut(false)
	n, err := io.ReadFull(peer, got[w:])
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read %d of %d bytes after the sender closed (%v), or not the ones written", w+n, len(data), err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
}

// gate is a connection whose reads wait while it is shut.
type gate struct {
	net.Conn
	mu     sync.Mutex
	cond   sync.Cond
	closed bool
}

func (g *gate) shut(closed bool) {
	g.mu.Lock()
	g.closed = closed
	g.mu.Unlock()
	g.cond.Broadcast()
}

func (g *gate) Read(p []byte) (int, error) {
	g.mu.Lock()
	for g.closed {
		g.cond.Wait()
	}
	g.mu.Unlock()
	return g.Conn.Read(p)
}

// waitFlushed waits until c has written out everything buffered.
func waitFlushed(t *testing.T, c *coalescedConn) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c.mu.Lock()
		done := c.first == nil && c.bulk == nil && !c.flushing
		c.mu.Unlock()
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the coalescer did not write out its buffer within 20s")
		}
		time.Sleep(time.Millisecond)
	}
}

// TestCoalesceStalledPeer: with the peer not reading, writes block once
// the socket and the buffer are full, and the write timeout then fails the
// write that is blocked and every one after it, as yamux's connection
// write timeout would without the buffer.
func TestCoalesceStalledPeer(t *testing.T) {
	client, server := tcpPair(t)
	const timeout = 300 * time.Millisecond
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: timeout}, holdControl)
	t.Cleanup(func() { c.Close() })
	var accepted atomic.Int64
	wrote := make(chan error, 1)
	go func() { wrote <- writeFrames(c, &accepted) }()
	select {
	case err := <-wrote:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("writes to a stalled peer ended with %v, want a timeout", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("writes to a stalled peer still accepted after 20s (%d bytes)", accepted.Load())
	}
	// What was taken is bounded by the socket buffers and the coalescer's.
	if n, bound := accepted.Load(), int64(socketBuffers(t, client, server)+2*maxCoalesce+(128<<10)); n > bound {
		t.Errorf("%d bytes accepted with the peer not reading, want at most %d", n, bound)
	}
	if _, err := c.Write(dataHeader(1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("a write after the timeout: %v", err)
	}
}

// TestCoalesceCloseUnblocksWriter: Close breaks off a flush blocked on a
// peer that does not read, within about closeFlushTimeout, and a write
// waiting for room then returns.
func TestCoalesceCloseUnblocksWriter(t *testing.T) {
	client, _ := tcpPair(t)
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: time.Hour}, holdControl)
	var accepted atomic.Int64
	wrote := make(chan error, 1)
	go func() { wrote <- writeFrames(c, &accepted) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		c.mu.Lock()
		blocked := c.waiting > 0
		c.mu.Unlock()
		if blocked {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no write blocked after 20s with the peer not reading (%d bytes accepted)", accepted.Load())
		}
		time.Sleep(time.Millisecond)
	}
	start := time.Now()
	c.Close()
	if d := time.Since(start); d > closeFlushTimeout+5*time.Second {
		t.Errorf("Close took %v with a stalled peer", d)
	}
	select {
	case err := <-wrote:
		if err == nil {
			t.Error("blocked write returned no error after Close")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a blocked write did not return after Close")
	}
}

// writeFrames writes 64 KiB data frames to c until a write fails, counting
// the bytes accepted.
func writeFrames(c net.Conn, accepted *atomic.Int64) error {
	body := make([]byte, 64<<10)
	for {
		for _, p := range [][]byte{dataHeader(len(body)), body} {
			n, err := c.Write(p)
			accepted.Add(int64(n))
			if err != nil {
				return err
			}
		}
	}
}

// socketBuffers is the most the kernel can hold between a writer and a
// reader that does not read: the writer's send buffer and the reader's
// receive buffer.
func socketBuffers(t *testing.T, w, r net.Conn) int {
	t.Helper()
	size := func(c net.Conn, opt int) int {
		rc, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var n int
		rc.Control(func(fd uintptr) { n, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, opt) })
		return n
	}
	return size(w, syscall.SO_SNDBUF) + size(r, syscall.SO_RCVBUF)
}

// TestCoalesceUnsentLimit: a coalesced connection over TLS over a batched
// socket, or behind a wrapper that names its connection, limits the
// socket's unsent bytes to its chunk within the bound; slow writes lower
// the limit to minChunk and fast ones raise it back; the kernel's send
// rate holds it at unsentTime of that rate.
func TestCoalesceUnsentLimit(t *testing.T) {
	client, server := tcpPair(t)
	tc, ts := tlsPair(t, Batched(client), Batched(server))
	t.Cleanup(func() { tc.Close(); ts.Close() })
	CoalesceWith(tc, CoalesceConfig{UnsentLimit: 40000})
	cs := Coalesce(wrapped{ts}).(*coalescedConn) // as the edge's listeners wrap their connections
	if tcpUnder(struct{ net.Conn }{client}) != nil {
		t.Error("found a TCP connection beneath a wrapper that does not name it")
	}
	check := func(c net.Conn, want int) {
		t.Helper()
		n, err := unsentLimit(c)
		if errors.Is(err, errors.ErrUnsupported) {
			t.Skip("no TCP_NOTSENT_LOWAT here")
		}
		if err != nil || n != want {
			t.Errorf("TCP_NOTSENT_LOWAT %d, %v; want %d", n, err, want)
		}
	}
	check(client, 40000)
	check(server, maxCoalesce)
	cs.mu.Lock()
	for range 10 {
		cs.adaptLocked(time.Second)
	}
	cs.mu.Unlock()
	check(server, minChunk)
	cs.mu.Lock()
	for range 10 {
		cs.adaptLocked(time.Microsecond)
	}
	cs.mu.Unlock()
	check(server, maxCoalesce)

	// The kernel's send rate raises the limit to unsentTime of it, within
	// the bound; a collapsed figure lowers it a quarter a sample.
	const rate = 30_000_000
	want := int(rate * unsentTime.Seconds())
	cs.mu.Lock()
	cs.noteRateLocked(time.Now(), rate)
	cs.adaptLocked(time.Second) // a slow write: the chunk halves, the rate holds the limit
	cs.mu.Unlock()
	check(server, want)
	cs.mu.Lock()
	cs.noteRateLocked(time.Now(), 0)
	cs.adaptLocked(time.Second)
	cs.mu.Unlock()
	check(server, want*3/4)
	cs.mu.Lock()
	cs.noteRateLocked(time.Now(), 1<<40)
	cs.adaptLocked(time.Second)
	cs.mu.Unlock()
	check(server, DefaultUnsentLimit)
}

// TestCoalesceSamplesSendRate: bulk written through a coalesced
// connection over TCP has the flusher read the kernel's send rate, at
// most once a rateSample.
func TestCoalesceSamplesSendRate(t *testing.T) {
	client, server := tcpPair(t)
	go io.Copy(io.Discard, server)
	c := CoalesceWith(client, CoalesceConfig{}).(*coalescedConn)
	t.Cleanup(func() { c.Close() })
	if sendRate(c.tcp) == 0 {
		t.Skip("no send rate from the kernel here")
	}
	body := make([]byte, 64<<10)
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, p := range [][]byte{frameHeader(yamuxTypeData, 0, 1, uint32(len(body))), body} {
			if _, err := c.Write(p); err != nil {
				t.Fatal(err)
			}
		}
		c.mu.Lock()
		rate, sampled := c.rate, c.sampled
		c.mu.Unlock()
		if rate > 0 {
			if sampled.IsZero() {
				t.Fatal("a rate without a sample time")
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no send rate sampled after 10 s of bulk writes")
		}
	}
}

// TestSendBufferSize: SO_SNDBUF is set only where it lets the socket hold
// more than the kernel's autotuning would, and never above the kernel's
// cap.
func TestSendBufferSize(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name            string
		n, auto, capped int
		want            int
	}{
		{"none asked", 0, 4 * mib, 4 * mib, 0},
		{"autotuning reaches it", 2 * mib, 4 * mib, 4 * mib, 0},
		{"doubled past autotuning", 8 * mib, 4 * mib, 4 * mib, 4 * mib},
		{"within the cap", 3 * mib, 4 * mib, 16 * mib, 3 * mib},
		{"a small cap would lower it", 8 * mib, 4 * mib, 208 << 10, 0},
	} {
		if got := sendBufferSize(tc.n, tc.auto, tc.capped); got != tc.want {
			t.Errorf("%s: sendBufferSize(%d, %d, %d) = %d, want %d", tc.name, tc.n, tc.auto, tc.capped, got, tc.want)
		}
	}
}

// TestCoalesceSendBuffer: SendBuffer sets the socket's SO_SNDBUF where
// this system's limits let it exceed autotuning, and no SendBuffer leaves
// the socket as it was.
func TestCoalesceSendBuffer(t *testing.T) {
	sndbuf := func(c net.Conn) int {
		t.Helper()
		rc, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var n int
		rc.Control(func(fd uintptr) { n, _ = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF) })
		return n
	}
	client, server := tcpPair(t)
	before := sndbuf(server)
	cs := CoalesceWith(server, CoalesceConfig{})
	t.Cleanup(func() { cs.Close() })
	if got := sndbuf(server); got != before {
		t.Errorf("SO_SNDBUF %d without SendBuffer, was %d", got, before)
	}
	const n = MaxWindow
	want := sendBufferFor(n)
	if want == 0 {
		t.Skipf("this system's autotuning reaches %d bytes already, or its limits are unknown", n)
	}
	cc := CoalesceWith(client, CoalesceConfig{SendBuffer: n})
	t.Cleanup(func() { cc.Close() })
	if got := sndbuf(client); got != 2*want {
		t.Errorf("SO_SNDBUF %d with SendBuffer %d, want %d (the kernel doubles %d)", got, n, 2*want, want)
	}
}

// TestCoalesceYamuxStress runs many concurrent echo streams of random sizes
// through coalesced, batched TLS connections, then closes the sessions
// while streams are still busy. It guards against lost wake-ups: every
// wait is bounded.
func TestCoalesceYamuxStress(t *testing.T) {
	cs, ss := tlsYamuxPair(t)
	go func() {
		for {
			st, err := ss.Accept()
			if err != nil {
				return
			}
			go func() {
				io.Copy(st, st)
				st.Close()
			}()
		}
	}()
	rng := rand.New(rand.NewPCG(1, 2))
	sizes := make([]int, 24)
	for i := range sizes {
		sizes[i] = 1 + rng.IntN(3<<20>>uint(i%4*3))
	}
	var wg sync.WaitGroup
	for i, n := range sizes {
		wg.Go(func() {
			st, err := cs.Open()
			if err != nil {
				t.Error(err)
				return
			}
			defer st.Close()
			st.SetDeadline(time.Now().Add(20 * time.Second))
			msg := make([]byte, n)
			for j := range msg {
				msg[j] = byte(i + j)
			}
			go st.Write(msg)
			got := make([]byte, n)
			if _, err := io.ReadFull(st, got); err != nil || !bytes.Equal(got, msg) {
				t.Errorf("stream %d (%d bytes): %v; equal %v", i, n, err, bytes.Equal(got, msg))
			}
		})
	}
	wg.Wait()
	// Close while streams are busy: nothing may hang.
	for range 8 {
		st, err := cs.Open()
		if err != nil {
			break
		}
		go st.Write(make([]byte, 1<<20))
		go io.Copy(io.Discard, st)
	}
	done := make(chan struct{})
	go func() {
		cs.Close()
		ss.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("closing busy sessions hung")
	}
}

// tlsPair runs TLS over client and server and returns both ends once
// their handshake is done.
func tlsPair(t *testing.T, client, server net.Conn) (*tls.Conn, *tls.Conn) {
	t.Helper()
	cert := selfSigned(t)
	roots := x509.NewCertPool()
	roots.AddCert(cert.Leaf)
	tc := tls.Client(client, &tls.Config{RootCAs: roots, ServerName: "localhost"})
	ts := tls.Server(server, &tls.Config{Certificates: []tls.Certificate{cert}})
	errc := make(chan error, 1)
	go func() { errc <- ts.Handshake() }()
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	return tc, ts
}

// tlsYamuxPair returns a yamux client and server over loopback TLS with
// batched sockets and coalesced writes on both sides, as agent and edge run.
func tlsYamuxPair(t *testing.T) (*yamux.Session, *yamux.Session) {
	t.Helper()
	client, server := tcpPair(t)
	tc, ts := tlsPair(t, Batched(client), Batched(server))
	cs, err := yamux.Client(Coalesce(tc), nil)
	if err != nil {
		t.Fatal(err)
	}
	ss, err := yamux.Server(Coalesce(ts), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close(); ss.Close() })
	return cs, ss
}

func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), crand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		DNSNames:     []string{"localhost"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
	}
	der, err := x509.CreateCertificate(crand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

// TestCoalesceSmallOvertakesBulk: while a download's frames wait for a
// slow peer, a small response, a ping and another stream's window update
// written after them leave ahead of them; the download's own frames, a
// small one and its FIN among them, keep their order.
func TestCoalesceSmallOvertakesBulk(t *testing.T) {
	client, server := tcpPair(t)
	server.(*net.TCPConn).SetReadBuffer(16 << 10)
	client.(*net.TCPConn).SetWriteBuffer(16 << 10)
	g := &gate{Conn: server}
	g.cond.L = &g.mu
	g.shut(true)
	t.Cleanup(func() { g.shut(false) })
	c := newCoalesced(client, CoalesceConfig{WriteTimeout: time.Minute}, time.Minute)
	t.Cleanup(func() { c.Close() })
	const bulkID, smallID = 3, 5
	var want []byte // the download's bytes in order
	frame := func(id uint32, body []byte) {
		for _, p := range [][]byte{frameHeader(yamuxTypeData, 0, id, uint32(len(body))), body} {
			if _, err := c.Write(p); err != nil {
				t.Fatal(err)
			}
		}
		if id == bulkID {
			want = append(want, body...)
		}
	}
	for i := 0; ; i++ {
		frame(bulkID, bytes.Repeat([]byte{byte(i)}, 32<<10))
		c.mu.Lock()
		queued := len(c.ends)
		c.mu.Unlock()
		if queued >= 4 { // the flusher is stuck on the socket, and frames wait behind it
			break
		}
		if i > 1000 {
			t.Fatal("no bulk frame waits though the peer does not read")
		}
	}
	frame(bulkID, []byte("small, but the download's"))
	fin := heldFrame(0x4, bulkID)
	c.Write(fin)
	frame(smallID, []byte("a small response"))
	ping := frameHeader(2, 0x1, 0, 9)
	update := frameHeader(yamuxTypeWindowUpdate, 0, 7, 1<<20)
	c.Write(ping)
	c.Write(update)

	g.shut(false)
	server.SetReadDeadline(time.Now().Add(20 * time.Second))
	var got []byte
	order := map[string]int{}
	for n := 0; ; n++ {
		h := make([]byte, yamuxHeaderSize)
		if _, err := io.ReadFull(server, h); err != nil {
			t.Fatalf("frame %d: %v", n, err)
		}
		body := make([]byte, 0)
		if h[1] == yamuxTypeData {
			body = make([]byte, binary.BigEndian.Uint32(h[8:]))
			if _, err := io.ReadFull(server, body); err != nil {
				t.Fatalf("frame %d body: %v", n, err)
			}
		}
		switch id := binary.BigEndian.Uint32(h[4:]); {
		case bytes.Equal(h, fin):
			order["fin"] = n
		case id == bulkID:
			got = append(got, body...)
			order["bulk"] = n // the last
		case id == smallID:
			order["small"] = n
		case bytes.Equal(h, ping):
			order["ping"] = n
		case bytes.Equal(h, update):
			order["update"] = n
		}
		if _, ok := order["fin"]; ok && len(order) == 5 {
			break
		}
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("the download's %d bytes arrived as %d, or out of order", len(want), len(got))
	}
	for _, k := range []string{"small", "ping", "update"} {
		if order[k] > order["bulk"] {
			t.Errorf("the %s frame (frame %d) came after the download's last (frame %d)", k, order[k], order["bulk"])
		}
	}
	if order["fin"] < order["bulk"] {
		t.Errorf("the download's FIN (frame %d) overtook its data (frame %d)", order["fin"], order["bulk"])
	}
}

// wrapped is a connection wrapper that names the connection beneath.
type wrapped struct{ net.Conn }

func (w wrapped) NetConn() net.Conn { return w.Conn }
