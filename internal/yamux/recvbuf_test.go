package yamux

import (
	"bytes"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestRecvBufferBounded: whatever the order of frames and reads, the
// buffer gives back exactly what was put in, and its capacity never passes
// the window while the unread data stays within it.
func TestRecvBufferBounded(t *testing.T) {
	const window = 1 << 20
	rng := rand.New(rand.NewPCG(1, 2))
	var b recvBuffer
	var in, out bytes.Buffer
	var next byte
	p := make([]byte, 96<<10)
	for range 3000 {
		if rng.IntN(2) == 0 {
			n := 1 + rng.IntN(64<<10)
			if b.Len()+n > window {
				continue // flow control keeps the peer within the window
			}
			sp := b.space(n, window)
			for i := range sp {
				sp[i] = next
				next += 7
			}
			in.Write(sp)
			b.buf = b.buf[:len(b.buf)+n]
		} else {
			n, _ := b.Read(p[:1+rng.IntN(len(p))])
			out.Write(p[:n])
		}
		if b.Cap() > window {
			t.Fatalf("capacity %d past the window %d with %d unread", b.Cap(), window, b.Len())
		}
	}
	for b.Len() > 0 {
		n, _ := b.Read(p)
		out.Write(p[:n])
	}
	if !bytes.Equal(in.Bytes(), out.Bytes()) {
		t.Fatalf("read back %d bytes of %d, or not the same ones", out.Len(), in.Len())
	}
}

// TestStreamBufferWithinWindow: a stream whose reader lags a whole window
// behind holds at most the window, not twice it as upstream's did.
func TestStreamBufferWithinWindow(t *testing.T) {
	a, b := tcpPair(t)
	cfg := testConf()
	cfg.MaxStreamWindowSize = 1 << 20
	client, err := Client(a, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := Server(b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()

	var wg sync.WaitGroup
	defer wg.Wait()
	st, err := client.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	wg.Go(func() {
		// Writes block once the window is full; the reader below only
		// starts after that.
		st.Write(make([]byte, 4<<20))
	})
	peer, err := server.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	// Let the window fill: the stream's unread data reaches the window.
	deadline := time.Now().Add(10 * time.Second)
	for {
		peer.recvLock.Lock()
		n := 0
		if peer.recvBuf != nil {
			n = peer.recvBuf.Len()
		}
		peer.recvLock.Unlock()
		if n >= 1<<20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d bytes unread after 10s, want the 1 MiB window", n)
		}
		time.Sleep(time.Millisecond)
	}
	buf := make([]byte, 16<<10) // reads smaller than the frames
	got := 0
	for got < 4<<20 {
		n, err := peer.Read(buf)
		if err != nil {
			t.Fatalf("read after %d bytes: %v", got, err)
		}
		got += n
		peer.recvLock.Lock()
		c := peer.recvBuf.Cap()
		peer.recvLock.Unlock()
		if c > 1<<20 {
			t.Fatalf("receive buffer of %d bytes for a 1 MiB window", c)
		}
	}
}
