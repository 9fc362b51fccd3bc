package edge

import (
	"net"
	"sync"
)

// limitListener closes connections past a total and a per-address bound of
// concurrent connections, before any TLS or HTTP work. The per-address
// count is taken at accept, or (lazy: behind PROXY protocol, where the
// address comes in the connection's first bytes) at the connection's first
// read, on the goroutine that serves it, so that a slow header never holds
// up accept.
type limitListener struct {
	net.Listener
	*connLimits
	lazy     bool
	onRefuse func(addr string)
}

// connLimits are the counts of one limit, which several listeners may
// share (the ports of TCP tunnels).
type connLimits struct {
	total, perIP int

	mu   sync.Mutex
	n    int
	byIP map[string]int
}

func newConnLimits(total, perIP int) *connLimits {
	return &connLimits{total: total, perIP: perIP, byIP: map[string]int{}}
}

func newLimitListener(ln net.Listener, total, perIP int, lazy bool, onRefuse func(string)) net.Listener {
	if total <= 0 && perIP <= 0 {
		return ln
	}
	return &limitListener{Listener: ln, connLimits: newConnLimits(total, perIP), lazy: lazy, onRefuse: onRefuse}
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if !l.acquire("") {
			l.refuse(c)
			continue
		}
		lc := &limitConn{Conn: c, l: l}
		if l.lazy {
			return lc, nil
		}
		if !lc.count() {
			continue
		}
		return lc, nil
	}
}

func (l *limitListener) refuse(c net.Conn) {
	if l.onRefuse != nil {
		l.onRefuse(c.RemoteAddr().String())
	}
	c.Close()
}

// acquire takes a connection of ip (of the total, for ""), unless at its
// bound.
func (l *connLimits) acquire(ip string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ip == "" {
		if l.total > 0 && l.n >= l.total {
			return false
		}
		l.n++
		return true
	}
	if l.perIP > 0 && l.byIP[ip] >= l.perIP {
		return false
	}
	l.byIP[ip]++
	return true
}

func (l *connLimits) release(ip string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ip == "" {
		l.n--
		return
	}
	if l.byIP[ip]--; l.byIP[ip] <= 0 {
		delete(l.byIP, ip)
	}
}

// limitConn gives its counts back when closed.
type limitConn struct {
	net.Conn
	l *limitListener

	once    sync.Once
	counted bool // its address's count was taken
	refused bool // its address was at its bound: closed
	ip      string
	closed  sync.Once
}

// NetConn returns the connection beneath, so that mux can tune its socket
// (the agent link's unsent limit and send buffer).
func (c *limitConn) NetConn() net.Conn { return c.Conn }

// count takes the count of c's address, once; false if it was at its bound
// (c is then closed).
func (c *limitConn) count() bool {
	c.once.Do(func() {
		c.ip = limiterKey(c.Conn.RemoteAddr().String())
		if c.counted = c.l.acquire(c.ip); !c.counted {
			c.refused = true
			c.l.refuse(c.Conn)
			c.Close()
		}
	})
	return !c.refused
}

func (c *limitConn) Read(p []byte) (int, error) {
	if !c.count() {
		return 0, net.ErrClosed
	}
	return c.Conn.Read(p)
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.closed.Do(func() {
		c.l.release("")
		if c.counted {
			c.l.release(c.ip)
		}
	})
	return err
}
