package wan

import (
	"io"
	"math/rand/v2"
	"sync"
	"time"
)

// lineLimit bounds the packets a direction holds on their way (in its
// delay line); a packet beyond it is dropped as an overflow.
const lineLimit = 1 << 14

// maxPacket is the largest packet the forwarder reads; the TUN devices'
// MTU (mtu) is below it.
const maxPacket = 4 << 10

// shaper decides the fate of each packet of one direction: dropped, or
// delivered at a time, after the packets before it have left at the
// link's rate, plus the delay.
type shaper struct {
	mu   sync.Mutex
	link Link
	down bool // black-holed
	rng  *rand.Rand
	free time.Time // when the packets admitted so far have left at the rate
	st   Stats
}

func newShaper(seed uint64) *shaper {
	return &shaper{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (s *shaper) set(l Link) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.link = l
}

func (s *shaper) blackhole(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = on
}

func (s *shaper) stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st
}

// admit returns when a packet of n bytes that arrives at now reaches the
// far side, or false if it is dropped.
func (s *shaper) admit(now time.Time, n int) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.down:
		s.st.Blackholed++
		return time.Time{}, false
	case s.link.Loss > 0 && s.rng.Float64() < s.link.Loss:
		s.st.Lost++
		return time.Time{}, false
	}
	leave := now
	if r := s.link.Rate; r > 0 {
		start := now
		if s.free.After(now) {
			start = s.free
		}
		waiting := int(float64(start.Sub(now)) / float64(time.Second) * float64(r))
		if waiting+n > s.link.queue() {
			s.st.Overflow++
			return time.Time{}, false
		}
		s.free = start.Add(time.Duration(float64(n) / float64(r) * float64(time.Second)))
		leave = s.free
		s.st.Waited += start.Sub(now)
	}
	s.st.Delivered++
	s.st.Bytes += uint64(n)
	return leave.Add(s.link.Delay), true
}

// overflow counts a packet dropped for want of room in the delay line.
func (s *shaper) overflow() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.st.Delivered--
	s.st.Overflow++
}

// packet is one packet on its way.
type packet struct {
	buf *[]byte
	n   int
	due time.Time
}

var packetBufs = sync.Pool{New: func() any { b := make([]byte, maxPacket); return &b }}

// pipe forwards one direction: packets read from in are shaped and written
// to out when due.
type pipe struct {
	in   io.Reader
	out  io.Writer
	s    *shaper
	line chan packet
}

func newPipe(in io.Reader, out io.Writer, seed uint64) *pipe {
	return &pipe{in: in, out: out, s: newShaper(seed), line: make(chan packet, lineLimit)}
}

// read takes packets from in until it fails (closed), then ends the line.
func (p *pipe) read() {
	defer close(p.line)
	for {
		b := packetBufs.Get().(*[]byte)
		n, err := p.in.Read(*b)
		if err != nil {
			packetBufs.Put(b)
			return
		}
		due, ok := p.s.admit(time.Now(), n)
		if !ok {
			packetBufs.Put(b)
			continue
		}
		select {
		case p.line <- packet{buf: b, n: n, due: due}:
		default:
			p.s.overflow()
			packetBufs.Put(b)
		}
	}
}

// earlySlack is how early a packet may leave rather than sleep: the
// runtime's timers wake no finer than about a millisecond, and sleeping
// that long for each of a burst of packets would throttle the link.
const earlySlack = 500 * time.Microsecond

// deliver writes each packet to out once it is due, until the line ends.
func (p *pipe) deliver() {
	for pk := range p.line {
		if d := time.Until(pk.due); d > earlySlack {
			time.Sleep(d)
		}
		p.out.Write((*pk.buf)[:pk.n]) // a packet the far side refuses is lost, as on a wire
		packetBufs.Put(pk.buf)
	}
}
