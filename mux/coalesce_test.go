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
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/yamux"
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
		c.appendLocked(p)
		want = append(want, p...)
		size := maxCoalesce
		switch {
		case len(want) <= smallCoalesce:
			size = smallCoalesce
		case len(want) <= mediumCoalesce:
			size = mediumCoalesce
		}
		if cap(*c.buf) != size {
			t.Fatalf("%d bytes queued in a %d-byte buffer, want %d", len(want), cap(*c.buf), size)
		}
	}
	if !bytes.Equal(*c.buf, want) {
		t.Fatal("the queued bytes changed as the buffer moved up")
	}
	putBuf(c.buf)
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
	h := make([]byte, yamuxHeaderSize)
	h[1] = yamuxTypeWindowUpdate
	binary.BigEndian.PutUint16(h[2:], flags)
	binary.BigEndian.PutUint32(h[4:], id)
	return h
}

func TestCoalesceHoldsControlFramesBriefly(t *testing.T) {
	client, server := tcpPair(t)
	c := Coalesce(client)
	t.Cleanup(func() { c.Close() })
	// A lone ACK leaves within holdControl even with nothing after it.
	ack := heldFrame(0x2, 7)
	start := time.Now()
	if _, err := c.Write(ack); err != nil {
		t.Fatal(err)
	}
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, yamuxHeaderSize)
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, ack) {
		t.Fatalf("held frame: %x, %v", got, err)
	}
	if d := time.Since(start); d < holdControl/2 {
		t.Errorf("held frame left after %v, before its hold", d)
	}
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
	// An RST, like any other frame, leaves at once.
	rst := heldFrame(0x8, 11)
	start = time.Now()
	c.Write(rst)
	got = make([]byte, yamuxHeaderSize)
	if _, err := io.ReadFull(server, got); err != nil || !bytes.Equal(got, rst) {
		t.Fatalf("RST: %x, %v", got, err)
	}
}

func TestCoalesceCloseSendsHeldFrames(t *testing.T) {
	client, server := tcpPair(t)
	c := Coalesce(client)
	fin := heldFrame(0x4, 3)
	if _, err := c.Write(fin); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(server)
	if err != nil || !bytes.Equal(b, fin) {
		t.Fatalf("peer read %x, %v; want the FIN, then EOF", b, err)
	}
}

// TestCoalesceCloseWrite: CloseWrite sends what is buffered, held frames
// included, then ends the writing side under TLS (close_notify): the peer
// reads every byte, then the end, while the reading side stays open.
func TestCoalesceCloseWrite(t *testing.T) {
	client, server := tcpPair(t)
	tc, ts := tlsPair(t, Batched(client), Batched(server))
	c := Coalesce(ts)
	t.Cleanup(func() { c.Close(); tc.Close() })
	body := bytes.Repeat([]byte("tail"), 64<<10)
	fin := heldFrame(0x4, 5)
	want := append(append(dataHeader(len(body)), body...), fin...)
	for _, p := range [][]byte{dataHeader(len(body)), body, fin} {
		if _, err := c.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	tc.SetDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(tc)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("peer read %d of %d bytes (%v), or not the ones written", len(got), len(want), err)
	}
	// The other way still works.
	if _, err := tc.Write([]byte("reply")); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b := make([]byte, 5)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "reply" {
		t.Fatalf("read after CloseWrite: %q, %v", b, err)
	}
	// Without a CloseWrite beneath, it says so.
	p1, _ := tcpPair(t)
	if err := Coalesce(struct{ net.Conn }{p1}).(interface{ CloseWrite() error }).CloseWrite(); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("CloseWrite over a conn without one: %v", err)
	}
}

// TestCoalesceStalledPeer: with the peer not reading, writes block once the
// buffer is full, and Close still returns within about closeFlushTimeout.
func TestCoalesceStalledPeer(t *testing.T) {
	client, _ := tcpPair(t)
	c := Coalesce(client)
	body := make([]byte, 64<<10)
	wrote := make(chan error, 1)
	go func() {
		for {
			if _, err := c.Write(dataHeader(len(body))); err != nil {
				wrote <- err
				return
			}
			if _, err := c.Write(body); err != nil {
				wrote <- err
				return
			}
		}
	}()
	time.Sleep(100 * time.Millisecond) // let the socket buffers fill
	start := time.Now()
	c.Close()
	if d := time.Since(start); d > closeFlushTimeout+2*time.Second {
		t.Errorf("Close took %v with a stalled peer", d)
	}
	select {
	case err := <-wrote:
		if err == nil {
			t.Error("blocked write returned no error after Close")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a blocked write did not return after Close")
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
