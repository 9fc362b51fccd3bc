package mux

import (
	"context"
	"encoding/binary"
	"net"
	"sync"
)

// InitialWindow is what yamux lets a stream send before the peer has
// answered its opening: every stream starts with a 256 KiB window, and the
// peer grants the rest of its window in the frame that accepts the stream
// (an ACK), a round trip after the opener's SYN.
const InitialWindow = 256 << 10

// yamux's frame flags the answer to a stream's opening carries.
const (
	yamuxFlagACK = 0x2
)

// answers follows the frames a coalescing connection reads, and records
// how far the peer has answered the streams this side opened: the highest
// stream id whose ACK (accepted, with the rest of the peer's window) or
// RST (refused) has come, of the even-numbered streams a yamux server
// opens: the peer's reset of one of its own streams (odd ids) answers
// nothing of this side's. A peer accepts streams in the order their SYNs
// reach it, so an answer to a later stream means an earlier one's came
// first, or the earlier one was refused. Two streams opened at once may
// send their SYNs out of order; then the later one's answer stands for
// the earlier's too, which costs only what waiting would have gained.
type answers struct {
	read frames // where the frame stream read so far stands; the reader's own

	mu      sync.Mutex
	highest uint32        // the highest stream id answered
	ended   bool          // nothing more will be read
	change  chan struct{} // closed at the next answer or the end; nil while none waits
}

// follow takes bytes read from the peer.
func (a *answers) follow(p []byte) {
	f := &a.read
	for len(p) > 0 {
		n, header, _, _ := f.step(p)
		p = p[n:]
		if header && binary.BigEndian.Uint16(f.hdr[2:])&(yamuxFlagACK|yamuxFlagRST) != 0 && f.stream()%2 == 0 {
			a.note(f.stream())
		}
	}
}

func (a *answers) note(id uint32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if id > a.highest {
		a.highest = id
		a.wakeLocked()
	}
}

// end records that the connection will read nothing more.
func (a *answers) end() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.ended = true
	a.wakeLocked()
}

func (a *answers) wakeLocked() {
	if a.change != nil {
		close(a.change)
		a.change = nil
	}
}

// wait waits until stream id has been answered, which it reports, or the
// connection has ended or ctx is done.
func (a *answers) wait(ctx context.Context, id uint32) bool {
	for {
		a.mu.Lock()
		if a.highest >= id || a.ended {
			answered := a.highest >= id
			a.mu.Unlock()
			return answered
		}
		if a.change == nil {
			a.change = make(chan struct{})
		}
		ch := a.change
		a.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		}
	}
}

// AwaitAnswer waits until the peer of c, a connection CoalesceWith made for
// a yamux session, has answered the opening of stream id (accepted it, and
// with that granted the stream its whole window, or refused it), and
// reports whether it has; it returns false when ctx is done or c has
// stopped reading first. Over a long round trip, a large body written at
// once into a new stream leaves as InitialWindow, then the rest a round
// trip later: the small first flight's losses put the TCP sender into
// recovery with a congestion window the size of that flight, which takes
// round trips to grow back (BENCHMARKS.md, run 10). On any other
// connection, or one made without CoalesceConfig.FollowAnswers, it returns
// true at once.
func AwaitAnswer(ctx context.Context, c net.Conn, id uint32) bool {
	cc, ok := c.(*coalescedConn)
	if !ok || !cc.cfg.FollowAnswers {
		return true
	}
	return cc.answers.wait(ctx, id)
}
