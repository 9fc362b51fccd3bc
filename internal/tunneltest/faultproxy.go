// Package tunneltest runs real edges, agents and a fault-injecting TCP proxy
// on loopback for ngstone's tests, as net/http/httptest does for servers.
package tunneltest

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// FaultProxy is a TCP proxy between an agent and the edge that can make its
// paths silent without closing them, reset them, or delay their bytes.
type FaultProxy struct {
	ln      net.Listener
	target  string
	targets []string // spread new connections in turn (SetTargets); nil: target
	turn    int

	mu      sync.Mutex
	cond    *sync.Cond
	blocked bool
	frozen  bool          // new connections are swallowed (Freeze)
	slow    time.Duration // the delay of new connections (Slow)
	links   map[*link]struct{}
	swallow map[net.Conn]struct{} // accepted while frozen: never relayed
	closed  bool
	wg      sync.WaitGroup

	returned atomic.Int64 // bytes read from the target side
}

// link is one proxied connection: two directions, each a reader queueing
// chunks and a writer releasing them when due.
type link struct {
	p     *FaultProxy
	a, b  net.Conn
	delay time.Duration // guarded by p.mu
	dead  bool          // frozen: carries nothing, ever; guarded by p.mu

	resetOnce sync.Once
	gone      chan struct{} // closed by reset
}

// isGone reports whether l was reset; false for nil.
func (l *link) isGone() bool {
	if l == nil {
		return false
	}
	select {
	case <-l.gone:
		return true
	default:
		return false
	}
}

type chunk struct {
	data []byte
	due  time.Time
}

// NewFaultProxy listens on a loopback port and forwards to target.
func NewFaultProxy(target string) (*FaultProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &FaultProxy{ln: ln, target: target, links: map[*link]struct{}{}, swallow: map[net.Conn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the address agents dial.
func (p *FaultProxy) Addr() string { return p.ln.Addr().String() }

// SetTarget sends new connections to addr, as a load balancer that moved
// to another backend; open connections keep theirs.
func (p *FaultProxy) SetTarget(addr string) {
	p.mu.Lock()
	p.target, p.targets = addr, nil
	p.mu.Unlock()
}

// SetTargets sends each new connection to the next of addrs in turn, as a
// round-robin load balancer; open connections keep theirs.
func (p *FaultProxy) SetTargets(addrs ...string) {
	p.mu.Lock()
	p.targets, p.turn = addrs, 0
	p.mu.Unlock()
}

// Block makes every path silent: connections stay open, bytes (and new
// connections' dials to the target) are held until Unblock.
func (p *FaultProxy) Block() {
	p.mu.Lock()
	p.blocked = true
	p.mu.Unlock()
}

// Unblock lets held and new bytes flow again, as when a network returns.
func (p *FaultProxy) Unblock() {
	p.mu.Lock()
	p.blocked = false
	p.cond.Broadcast()
	p.mu.Unlock()
}

// Freeze makes the path silent for good, as a load balancer in front of a
// stopped or dead backend is: the connections open now carry nothing from
// then on, and those accepted until Thaw complete their handshake and are
// never relayed. Nothing is closed.
func (p *FaultProxy) Freeze() {
	p.mu.Lock()
	p.frozen = true
	for l := range p.links {
		l.dead = true
	}
	p.mu.Unlock()
}

// Thaw relays the connections accepted from then on; those frozen stay
// silent.
func (p *FaultProxy) Thaw() {
	p.mu.Lock()
	p.frozen = false
	p.mu.Unlock()
}

// DelayExisting delays every byte of the connections open now by d; new
// connections are not delayed.
func (p *FaultProxy) DelayExisting(d time.Duration) {
	p.mu.Lock()
	for l := range p.links {
		l.delay = d
	}
	p.mu.Unlock()
}

// Slow delays every byte of every connection, open now or opened later,
// by d (zero: none), as a slow or overloaded server would.
func (p *FaultProxy) Slow(d time.Duration) {
	p.mu.Lock()
	p.slow = d
	for l := range p.links {
		l.delay = d
	}
	p.mu.Unlock()
}

// Reset closes every open connection abruptly (RST).
func (p *FaultProxy) Reset() {
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	for _, l := range links {
		l.reset()
	}
}

// Returned returns how many bytes the target side has sent through the
// proxy, held ones included: it tells which of several paths carries a
// stream.
func (p *FaultProxy) Returned() int64 { return p.returned.Load() }

// Links returns how many connections are open.
func (p *FaultProxy) Links() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.links)
}

// Close stops the proxy, resets every connection and waits for its goroutines.
func (p *FaultProxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.blocked = false
	p.cond.Broadcast()
	swallowed := make([]net.Conn, 0, len(p.swallow))
	for c := range p.swallow {
		swallowed = append(swallowed, c)
	}
	p.mu.Unlock()
	for _, c := range swallowed {
		c.Close()
	}
	p.ln.Close()
	p.Reset()
	p.wg.Wait()
}

func (p *FaultProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// waitOpen blocks while the proxy is blocked; false once it is closed.
func (p *FaultProxy) waitOpen() bool { return p.waitLink(nil) }

// waitLink blocks while the proxy is blocked or l (nil: none) is frozen;
// false once the proxy is closed or l reset.
func (p *FaultProxy) waitLink(l *link) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for (p.blocked || l != nil && l.dead) && !p.closed && !l.isGone() {
		p.cond.Wait()
	}
	return !p.closed && !l.isGone()
}

// swallowConn holds a connection accepted while frozen, reading and
// dropping what arrives, until its client or Close closes it.
func (p *FaultProxy) swallowConn(a net.Conn) {
	p.swallow[a] = struct{}{} // p.mu is held
	p.mu.Unlock()
	io.Copy(io.Discard, a)
	p.mu.Lock()
	delete(p.swallow, a)
	p.mu.Unlock()
	a.Close()
}

func (p *FaultProxy) serve(a net.Conn) {
	defer p.wg.Done()
	p.mu.Lock()
	if p.frozen && !p.closed {
		p.swallowConn(a)
		return
	}
	p.mu.Unlock()
	if !p.waitOpen() {
		a.Close()
		return
	}
	p.mu.Lock()
	target := p.target
	if len(p.targets) > 0 {
		target = p.targets[p.turn%len(p.targets)]
		p.turn++
	}
	p.mu.Unlock()
	b, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		a.Close()
		return
	}
	l := &link{p: p, a: a, b: b, gone: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		l.reset()
		return
	}
	p.links[l] = struct{}{}
	l.delay = p.slow
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); l.pipe(a, b) }()
	go func() { defer wg.Done(); l.pipe(b, a) }()
	wg.Wait()
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
	l.reset()
}

// pipe copies src to dst through a queue, so that a delay shifts bytes in
// time without slowing the reader.
func (l *link) pipe(src, dst net.Conn) {
	q := make(chan chunk, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for c := range q {
			if d := time.Until(c.due); d > 0 {
				t := time.NewTimer(d) // the simulated network delay itself
				select {
				case <-t.C:
				case <-l.gone:
					t.Stop()
					return
				}
			}
			if !l.p.waitLink(l) {
				return
			}
			if _, err := dst.Write(c.data); err != nil {
				l.reset()
				return
			}
		}
		if tc, ok := dst.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if src == l.b {
			l.p.returned.Add(int64(n))
		}
		if n > 0 {
			l.p.mu.Lock()
			d := l.delay
			l.p.mu.Unlock()
			select {
			case q <- chunk{data: append([]byte(nil), buf[:n]...), due: time.Now().Add(d)}:
			case <-done:
			}
		}
		if err != nil {
			l.p.mu.Lock()
			dead := l.dead
			l.p.mu.Unlock()
			if dead || !errors.Is(err, io.EOF) {
				l.reset() // a frozen link's writer waits for nothing else
			}
			close(q)
			<-done
			return
		}
	}
}

func (l *link) reset() {
	l.resetOnce.Do(func() {
		close(l.gone)
		l.p.mu.Lock()
		l.p.cond.Broadcast() // a frozen writer in waitLink
		l.p.mu.Unlock()
	})
	for _, c := range []net.Conn{l.a, l.b} {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
	}
}

// StartFaultProxy runs a FaultProxy to target until the test ends.
func StartFaultProxy(t testing.TB, target string) *FaultProxy {
	t.Helper()
	p, err := NewFaultProxy(target)
	if err != nil {
		t.Fatalf("fault proxy: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}
