package mux

import (
	"bytes"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

func TestBatchedReadsInOrderAndHoldsNoBufferIdle(t *testing.T) {
	client, server := tcpPair(t)
	bc := Batched(client).(*batchedConn)
	client.SetReadDeadline(time.Now().Add(10 * time.Second))

	// A small message, read with a small buffer: straight through.
	server.Write([]byte("hello"))
	p := make([]byte, 1000)
	if n, err := bc.Read(p); err != nil || string(p[:n]) != "hello" {
		t.Fatalf("read %q, %v", p[:n], err)
	}
	if bc.rbuf != nil {
		t.Fatal("an idle read kept a batch buffer")
	}

	// A stream read in small pieces: in order, through batch buffers,
	// and none kept once it is all read.
	msg := make([]byte, 3<<20)
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	go server.Write(msg)
	var got bytes.Buffer
	batched := false
	for got.Len() < len(msg) {
		n, err := bc.Read(p[:1000])
		if err != nil {
			t.Fatalf("after %d bytes: %v", got.Len(), err)
		}
		got.Write(p[:n])
		batched = batched || bc.rbuf != nil
	}
	if !bytes.Equal(got.Bytes(), msg) {
		t.Fatal("bytes differ from those written")
	}
	if !batched {
		t.Error("a 3 MiB stream read 1000 bytes at a time never used a batch buffer")
	}
	if bc.rbuf != nil {
		t.Error("a batch buffer kept after the stream was read")
	}

	// The error after the data comes after the data.
	server.Write([]byte("end"))
	server.Close()
	b, err := io.ReadAll(bc)
	if err != nil || string(b) != "end" {
		t.Fatalf("read %q, %v; want the last bytes, then EOF", b, err)
	}
}

func TestBatchedWritesPassThroughUncorked(t *testing.T) {
	client, server := tcpPair(t)
	bc := Batched(client).(*batchedConn)
	bc.Write([]byte("direct "))
	bc.cork()
	bc.Write([]byte("gathered "))
	bc.Write([]byte("records"))
	if c := cap(*bc.wbuf); c != corkSmall {
		t.Errorf("two small corked writes gather in a %d-byte buffer, want the %d-byte one", c, corkSmall)
	}
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	p := make([]byte, 64)
	n, _ := io.ReadAtLeast(server, p, len("direct "))
	if string(p[:n]) != "direct " {
		t.Fatalf("read %q before uncork; want only the uncorked write", p[:n])
	}
	if err := bc.uncork(); err != nil {
		t.Fatal(err)
	}
	want := "gathered records"
	if n, err := io.ReadFull(server, p[:len(want)]); err != nil || string(p[:n]) != want {
		t.Fatalf("read %q, %v; want %q", p[:n], err, want)
	}
}

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int32
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// TestCork: the four TLS records of one 64 KiB write to a corked
// connection reach the socket in one write, and read back whole; Cork
// declines a connection that is not TLS over a batched socket.
func TestCork(t *testing.T) {
	client, server := tcpPair(t)
	counted := &countingConn{Conn: server}
	tc, ts := tlsPair(t, client, Batched(counted))
	msg := make([]byte, 64<<10)
	for i := range msg {
		msg[i] = byte(i * 13)
	}
	got := make(chan []byte, 1)
	go func() {
		b := make([]byte, len(msg))
		io.ReadFull(tc, b)
		got <- b
	}()
	before := counted.writes.Load()
	uncork := Cork(ts)
	if uncork == nil {
		t.Fatal("Cork declined a TLS connection over a batched socket")
	}
	if _, err := ts.Write(msg); err != nil {
		t.Fatal(err)
	}
	if err := uncork.Uncork(); err != nil {
		t.Fatal(err)
	}
	if n := counted.writes.Load() - before; n != 1 {
		t.Errorf("a corked 64 KiB write took %d socket writes, want 1", n)
	}
	select {
	case b := <-got:
		if !bytes.Equal(b, msg) {
			t.Fatal("the corked bytes differ from those written")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the corked write never arrived")
	}
	if Cork(tc) != nil || Cork(client) != nil {
		t.Error("Cork accepted a connection without a batched socket")
	}
}
