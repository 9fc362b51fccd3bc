package main

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRelayChain: two relays in a row, as the floor runs them, carry bytes
// both ways, pass a half-close on, and stop when their context ends.
func TestRelayChain(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	echoed := make(chan error, 1)
	go func() {
		c, err := echo.Accept()
		if err != nil {
			echoed <- err
			return
		}
		defer c.Close()
		_, err = io.Copy(c, c) // until the client's half-close arrives
		echoed <- err
	}()

	ctx, cancel := context.WithCancel(context.Background())
	to := echo.Addr().String()
	done := make(chan error, 2)
	for range 2 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func(to string) { done <- relay(ctx, ln, to) }(to)
		to = ln.Addr().String()
	}

	c, err := net.Dial("tcp", to)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := make([]byte, 1<<20)
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	go func() {
		c.Write(msg)
		c.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != string(msg) {
		t.Fatalf("read %d of %d bytes back (%v), or not the same ones", len(got), len(msg), err)
	}
	if err := <-echoed; err != nil {
		t.Fatalf("echo: %v", err)
	}
	cancel()
	for range 2 {
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("relay returned %v, want context.Canceled", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a relay did not stop within 10s of its context's end")
		}
	}
}
