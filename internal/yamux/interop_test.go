package yamux

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	upstream "github.com/hashicorp/yamux"
)

// muxSession is what this package's and upstream's sessions share.
type muxSession interface {
	Open() (net.Conn, error)
	Accept() (net.Conn, error)
	Close() error
}

// TestInteropUpstream: this package and the upstream module it was copied
// from speak the same protocol, each as client and as server: streams
// opened both ways carry more than a window of data in each direction,
// half-close, and the sessions close cleanly.
func TestInteropUpstream(t *testing.T) {
	for _, ours := range []string{"client", "server"} {
		t.Run("ours as "+ours, func(t *testing.T) {
			a, b := tcpPair(t)
			var c, s muxSession
			var err error
			if ours == "client" {
				c, err = Client(a, nil)
				if err == nil {
					s, err = upstream.Server(b, nil)
				}
			} else {
				c, err = upstream.Client(a, nil)
				if err == nil {
					s, err = Server(b, nil)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			defer s.Close()
			// Each side opens a stream that the other echoes.
			for _, pair := range [][2]muxSession{{c, s}, {s, c}} {
				echoed := make(chan error, 1)
				go func() {
					st, err := pair[1].Accept()
					if err != nil {
						echoed <- err
						return
					}
					defer st.Close()
					_, err = io.Copy(st, st)
					echoed <- err
				}()
				st, err := pair[0].Open()
				if err != nil {
					t.Fatal(err)
				}
				st.SetDeadline(time.Now().Add(10 * time.Second))
				msg := make([]byte, 3<<20) // more than the 256 KiB window, in both directions
				for i := range msg {
					msg[i] = byte(rand.IntN(256))
				}
				go func() {
					st.Write(msg)
					st.Close() // half-close: the echo ends at our FIN
				}()
				got, err := io.ReadAll(st)
				if err != nil || !bytes.Equal(got, msg) {
					t.Fatalf("read back %d of %d bytes (%v), or not the same ones", len(got), len(msg), err)
				}
				if err := <-echoed; err != nil {
					t.Fatalf("echo: %v", err)
				}
			}
		})
	}
}

func tcpPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ln.Accept()
	if err != nil {
		a.Close()
		t.Fatal(err)
	}
	return a, b
}
