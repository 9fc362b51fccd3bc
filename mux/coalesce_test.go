package mux

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
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
