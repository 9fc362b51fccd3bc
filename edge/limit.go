package edge

import (
	"net"
	"sync"
)

// limitListener closes connections past a total and a per-address bound of
// concurrent visitor connections, at once, before any TLS or HTTP work.
type limitListener struct {
	net.Listener
	total, perIP int
	onRefuse     func(addr string)

	mu   sync.Mutex
	n    int
	byIP map[string]int
}

func newLimitListener(ln net.Listener, total, perIP int, onRefuse func(string)) net.Listener {
	if total <= 0 && perIP <= 0 {
		return ln
	}
	return &limitListener{Listener: ln, total: total, perIP: perIP, onRefuse: onRefuse, byIP: map[string]int{}}
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ip := hostOf(c.RemoteAddr().String())
		if l.acquire(ip) {
			return &limitConn{Conn: c, release: func() { l.release(ip) }}, nil
		}
		if l.onRefuse != nil {
			l.onRefuse(c.RemoteAddr().String())
		}
		c.Close()
	}
}

func (l *limitListener) acquire(ip string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if (l.total > 0 && l.n >= l.total) || (l.perIP > 0 && l.byIP[ip] >= l.perIP) {
		return false
	}
	l.n++
	l.byIP[ip]++
	return true
}

func (l *limitListener) release(ip string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n--
	if l.byIP[ip]--; l.byIP[ip] <= 0 {
		delete(l.byIP, ip)
	}
}

type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
