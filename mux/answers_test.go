package mux

import (
	"bytes"
	"context"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// answered reports what AwaitAnswer says of stream id within d.
func answered(c net.Conn, id uint32, d time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return AwaitAnswer(ctx, c, id)
}

func TestAwaitAnswerUnderYamux(t *testing.T) {
	client, server := tcpPair(t)
	cc := CoalesceWith(client, CoalesceConfig{FollowAnswers: true})
	yc := yamux.DefaultConfig()
	yc.AcceptBacklog = 1
	yc.LogOutput = bytes.NewBuffer(nil)
	cs, err := yamux.Client(cc, yc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	sc := CoalesceWith(server, CoalesceConfig{FollowAnswers: true})
	ss, err := yamux.Server(sc, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })

	first, err := ss.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if answered(sc, first.StreamID(), 100*time.Millisecond) {
		t.Fatal("a stream the peer has not accepted counts as answered")
	}
	st, err := cs.AcceptStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if !answered(sc, first.StreamID(), 10*time.Second) {
		t.Fatal("the peer's acceptance of the stream did not count")
	}

	// The client's backlog holds one stream: a second waits there, a third
	// is refused (RST), and a refusal is an answer too.
	second, err := ss.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	third, err := ss.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer third.Close()
	if !answered(sc, third.StreamID(), 10*time.Second) {
		t.Fatal("the peer's refusal of the stream did not count")
	}

	// A session that ends ends the wait, well before its deadline.
	fourth, err := ss.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	defer fourth.Close()
	cs.Close()
	start := time.Now()
	if answered(sc, fourth.StreamID()+2, 10*time.Second) {
		t.Fatal("a stream never opened counts as answered")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the wait outlived the connection by %s", d)
	}
}

// A data frame's body shaped like an answer to a stream is body, not an
// answer; frames split at any byte are followed as whole ones; the peer's
// reset of a stream it opened itself (an odd id) answers none of ours.
func TestAnswersFollowFrames(t *testing.T) {
	fake := frameHeader(yamuxTypeWindowUpdate, yamuxFlagACK, 1000, 0)
	body := append(bytes.Repeat(fake, 3), 'x')
	var stream []byte
	stream = append(stream, frameHeader(yamuxTypeData, 0, 5, uint32(len(body)))...)
	stream = append(stream, body...)
	stream = append(stream, frameHeader(yamuxTypeWindowUpdate, yamuxFlagACK, 6, 1<<20)...)
	stream = append(stream, frameHeader(yamuxTypeData, yamuxFlagACK, 8, 3)...)
	stream = append(stream, "abc"...)
	stream = append(stream, frameHeader(yamuxTypeWindowUpdate, yamuxFlagRST, 10, 0)...)
	stream = append(stream, frameHeader(yamuxTypeWindowUpdate, yamuxFlagRST, 11, 0)...)
	stream = append(stream, frameHeader(yamuxTypeWindowUpdate, yamuxFlagACK, 13, 1<<20)...)
	for _, size := range []int{1, 5, 12, 13, len(stream)} {
		var a answers
		var seen []uint32
		for p := stream; len(p) > 0; {
			n := min(size, len(p))
			a.follow(p[:n])
			p = p[n:]
			if len(seen) == 0 || seen[len(seen)-1] != a.highest {
				seen = append(seen, a.highest)
			}
		}
		if want := []uint32{0, 6, 8, 10}; size == 1 && !slices.Equal(seen, want) {
			t.Errorf("byte by byte: answers seen %v, want %v", seen, want)
		}
		if a.highest != 10 {
			t.Errorf("in pieces of %d: highest answer %d, want 10 (1000 is a body's bytes, 11 and 13 the peer's own streams)", size, a.highest)
		}
	}
}

func TestAwaitAnswerOtherConn(t *testing.T) {
	client, _ := tcpPair(t)
	if !answered(client, 2, time.Millisecond) {
		t.Fatal("a connection that follows no frames should not hold a writer back")
	}
}
