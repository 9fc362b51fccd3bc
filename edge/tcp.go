package edge

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// TCP tunnels. The edge listens on every port of TCPPorts; a port is bound
// in the registry as mux.TCPKey(port), under the binding rules of every
// name. Each visitor connection crosses the tunnel as one exchange on a
// stream of the owning session's, on the request path of every exchange
// (streamTransport): its request body is what the visitor sends, its
// response body what the local service sends, each chunked and flushed as
// it comes, so that the end of either body is that side's half-close. The
// stream is closed after it (Connection: close).

// Results of a visitor connection: ngstone_tcp_connections_total{result}.
const (
	tcpRelayed     = "relayed"
	tcpNoTunnel    = "no_tunnel"
	tcpOffline     = "offline"
	tcpIPDenied    = "ip_denied"
	tcpLimited     = "limited"     // the session's stream limit
	tcpUnreachable = "unreachable" // the agent could not reach its local service
	tcpFailed      = "failed"
)

// tcpLinger is how long a connection whose local service has closed waits
// for the visitor's own close before it is closed.
const tcpLinger = time.Second

// freePortTries bounds the binds tried for a port of no reservation.
const freePortTries = 64

// listenTCP binds every port of TCPPorts on the visitors' host, all counted
// against one connection limit.
func (e *Edge) listenTCP() error {
	if len(e.cfg.TCPPorts) == 0 {
		return nil
	}
	host := e.tcpHost()
	var lim *connLimits
	if e.cfg.MaxConns > 0 || e.cfg.MaxConnsPerIP > 0 {
		lim = newConnLimits(e.cfg.MaxConns, e.cfg.MaxConnsPerIP)
	}
	for _, r := range e.cfg.TCPPorts {
		for p := r.Lo; p <= r.Hi; p++ {
			if e.tcpLns[p] != nil {
				continue
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p)))
			if err != nil {
				return fmt.Errorf("tcp-ports: port %d: %w", p, err)
			}
			if lim != nil {
				ln = &limitListener{Listener: ln, connLimits: lim, onRefuse: e.tcpRefused}
			}
			e.tcpLns[p] = ln
		}
	}
	return nil
}

// tcpHost is the host the TCP ports listen on: the HTTPS listener's, else
// the HTTP one's ("" for every interface).
func (e *Edge) tcpHost() string {
	for _, a := range []string{e.cfg.HTTPSAddr, e.cfg.HTTPAddr} {
		if h, _, err := net.SplitHostPort(a); err == nil {
			return h
		}
	}
	return ""
}

func (e *Edge) tcpRefused(addr string) {
	e.metrics.limited(limitVisitorConns)
	e.metrics.tcpConns.WithLabelValues(tcpLimited).Inc()
	e.log.Debug("tcp visitor connection refused: connection limit", "remote", addr)
}

// serveTCP accepts the visitors of every TCP port.
func (e *Edge) serveTCP(ctx context.Context) {
	for p, ln := range e.tcpLns {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			acceptLoop(ln, e.log, func() { e.metrics.acceptFailed("tcp") }, func(c net.Conn) {
				e.wg.Add(1)
				go func() {
					defer e.wg.Done()
					defer c.Close()
					e.metrics.tcpConns.WithLabelValues(e.relayConn(ctx, c, mux.TCPKey(p))).Inc()
				}()
			})
		}()
	}
}

// TCPAddr returns the address TCP port p listens on; nil if it does not.
func (e *Edge) TCPAddr(p int) net.Addr {
	if ln := e.tcpLns[p]; ln != nil {
		return ln.Addr()
	}
	return nil
}

// relayConn relays visitor connection c to the agent holding key (a TCP
// port's, or a TLS passthrough's name), through this edge's session or
// the owning edge's, and says how it went.
func (e *Edge) relayConn(ctx context.Context, c net.Conn, key string) string {
	b, ok, err := e.lookup(ctx, key)
	switch {
	case err != nil:
		return tcpOffline
	case !ok:
		return tcpNoTunnel
	}
	pool := b.Pool
	if b, _, ok = e.pick(b, nil); !ok {
		return tcpOffline
	}
	ip, _ := netip.ParseAddr(hostOf(c.RemoteAddr().String()))
	rt := route{node: b.Node, hostname: key, generation: b.Generation, relay: true, pool: pool}
	if e.local(b) {
		rt.s = e.session(b.SessionID)
		if rt.s == nil || !rt.s.live(time.Now()) {
			return tcpOffline
		}
		if !rt.s.allows(key, ip) {
			e.metrics.limited(limitIPDenied)
			return tcpIPDenied
		}
	}
	ctx, cancel := context.WithCancel(context.WithValue(ctx, routeKey{}, rt))
	defer cancel()
	vc := newTCPVisitor(c, e.cfg.TCPIdleTimeout, e.cfg.WriteTimeout, e.metrics, cancel)
	defer vc.stop()
	up := &tcpUpload{c: vc, forwarded: rt.s == nil, done: make(chan struct{})}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://ngstone/", up)
	// A stream carries one connection: the local service's close may end
	// the exchange while the visitor still sends, and a stream taken
	// again could find the agent closing it.
	req.Host, req.ContentLength, req.Close = key, -1, true
	req.Header.Set("X-Forwarded-For", ip.Unmap().String())
	// For the agent's PROXY protocol header: where the visitor came from,
	// and what of the edge's it connected to.
	req.Header.Set(mux.HeaderTCPSource, c.RemoteAddr().String())
	req.Header.Set(mux.HeaderTCPDestination, c.LocalAddr().String())
	head := time.AfterFunc(e.cfg.TunnelTimeout, cancel) // an agent that never answers
	resp, err := (&routeTransport{e: e, local: &streamTransport{e: e}}).RoundTrip(req)
	head.Stop()
	switch {
	case errors.Is(err, errTooManyStreams):
		e.metrics.limited(limitSessionStreams)
		return tcpLimited
	case errors.Is(err, errIPDenied):
		return tcpIPDenied
	case errors.Is(err, errNoRoute), errors.Is(err, errRegistry):
		return tcpOffline
	case errors.Is(err, errNotBound):
		return tcpNoTunnel
	case err != nil:
		e.log.Debug("tcp tunnel failed", "key", key, "err", err)
		return tcpFailed
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return refusedBy(resp)
	}
	if _, err := io.Copy(vc, resp.Body); err != nil {
		return tcpRelayed // either side went away: the connection is over
	}
	closeWrite(c)
	t := time.NewTimer(tcpLinger)
	defer t.Stop()
	select {
	case <-up.done:
	case <-t.C:
	}
	return tcpRelayed
}

// refusedBy says why the agent, or the owning edge, refused a relay.
func refusedBy(resp *http.Response) string {
	switch resp.Header.Get(mux.ErrorHeader) {
	case mux.CodeIPDenied:
		return tcpIPDenied
	case mux.CodeTunnelOffline, mux.CodeMisdirected:
		return tcpOffline
	case mux.CodeTooManyRequests:
		return tcpLimited
	}
	return tcpUnreachable
}

// closeWrite half-closes c (beneath the limit's wrapper), or closes it.
func closeWrite(c net.Conn) {
	for {
		switch v := c.(type) {
		case interface{ CloseWrite() error }:
			v.CloseWrite()
			return
		case interface{ NetConn() net.Conn }:
			c = v.NetConn()
		default:
			c.Close()
			return
		}
	}
}

// tcpUpload is a visitor's bytes as a request body; done is closed once
// the transport is through with it, or for a forwarded one (whose body
// the transport does not close, see unreadBody) once the visitor's side
// ended.
type tcpUpload struct {
	c         *tcpVisitor
	forwarded bool
	once      sync.Once
	done      chan struct{}
}

func (u *tcpUpload) Read(p []byte) (int, error) {
	n, err := u.c.Read(p)
	if err != nil && u.forwarded {
		u.Close()
	}
	return n, err
}

func (u *tcpUpload) Close() error {
	u.once.Do(func() { close(u.done) })
	return nil
}

// tcpVisitor is a visitor connection closed, and its exchange ended
// (end), once no byte has crossed it either way for idle; each write must
// make progress within write.
type tcpVisitor struct {
	net.Conn
	write   time.Duration
	in, out prometheus.Counter
	last    atomic.Int64 // unix nanoseconds of the last byte either way
	timer   *time.Timer
}

func newTCPVisitor(c net.Conn, idle, write time.Duration, m *metrics, end func()) *tcpVisitor {
	v := &tcpVisitor{Conn: c, write: write,
		in: m.tcpBytes.WithLabelValues("in"), out: m.tcpBytes.WithLabelValues("out")}
	v.last.Store(time.Now().UnixNano())
	// Armed once v.timer is set, which check reads.
	v.timer = time.AfterFunc(math.MaxInt64, func() {
		quiet := time.Since(time.Unix(0, v.last.Load()))
		if quiet >= idle {
			c.Close()
			end()
			return
		}
		v.timer.Reset(idle - quiet)
	})
	v.timer.Reset(idle)
	return v
}

func (v *tcpVisitor) stop() { v.timer.Stop() }

func (v *tcpVisitor) Read(p []byte) (int, error) {
	n, err := v.Conn.Read(p)
	if n > 0 {
		v.last.Store(time.Now().UnixNano())
		v.in.Add(float64(n))
	}
	return n, err
}

func (v *tcpVisitor) Write(p []byte) (int, error) {
	v.Conn.SetWriteDeadline(time.Now().Add(v.write))
	n, err := v.Conn.Write(p)
	if n > 0 {
		v.last.Store(time.Now().UnixNano())
		v.out.Add(float64(n))
	}
	return n, err
}

// bindTCP answers a bind of a public TCP port: the one asked for, else the
// one kept for the token and the tunnel's label, else a free one.
func (e *Edge) bindTCP(ctx context.Context, s *session, m *mux.Bind, access *visitorAccess) mux.Message {
	refuse := func(code, msg string) mux.Message {
		s.log.Info("bind refused", "port", m.Port, "code", code)
		return &mux.BindError{Code: code, Message: msg}
	}
	switch {
	case len(e.cfg.TCPPorts) == 0:
		return refuse(mux.CodeUnauthorized, "this edge serves no TCP tunnels: its operator turns them on with --tcp-ports")
	case m.Port == 0:
		return e.bindAnyPort(ctx, s, m, access)
	case !mux.PortsContain(e.cfg.TCPPorts, m.Port):
		return refuse(mux.CodeInvalidName, fmt.Sprintf("port %d is not one of the edge's TCP ports (%s): choose another --remote-port", m.Port, mux.PortsString(e.cfg.TCPPorts)))
	case !s.policy.allowsPort(m.Port):
		return refuse(mux.CodeUnauthorized, fmt.Sprintf("this token may not hold port %d; it may hold %v", m.Port, s.policy.TCPPorts))
	}
	return e.claim(ctx, s, mux.TCPKey(m.Port), m.Takeover, false, access, e.tcpClaim(m))
}

// tcpClaim is what a TCP bind adds to a claim: the reservation.
func (e *Edge) tcpClaim(m *mux.Bind) *registry.Claim {
	return &registry.Claim{Reserve: e.cfg.TCPPortReserve, Label: m.Label, Pool: m.Pool}
}

// bindAnyPort binds the port kept for the token and m's label when it can
// take it back, else a free port it may hold.
func (e *Edge) bindAnyPort(ctx context.Context, s *session, m *mux.Bind, access *visitorAccess) mux.Message {
	if r, ok := e.store.(registry.Reserver); ok {
		kept, _ := r.ReservedFor(ctx, s.tokenID, m.Label)
		for _, k := range kept {
			p, ok := mux.ParseTCPKey(k.Key)
			if !ok || !mux.PortsContain(e.cfg.TCPPorts, p) || !s.policy.allowsPort(p) {
				continue
			}
			reply := e.claim(ctx, s, k.Key, m.Takeover, false, access, e.tcpClaim(m))
			if _, ok := reply.(*mux.BindOK); ok {
				return reply
			}
		}
	}
	free, err := e.freePorts(ctx, s.policy)
	if err != nil {
		s.log.Error("bind failed: listing the TCP ports in use", "err", err)
		return &mux.BindError{Code: mux.CodeUnavailable, Message: "the edge could not read which TCP ports are in use; retrying"}
	}
	r, _ := e.store.(registry.Reserver)
	tries := 0
	for _, p := range free {
		if tries == freePortTries {
			break
		}
		if r != nil {
			// Read only for the ports tried: the claim checks it again.
			if _, kept, err := r.Reservation(ctx, mux.TCPKey(p)); err != nil || kept {
				continue
			}
		}
		tries++
		reply := e.claim(ctx, s, mux.TCPKey(p), false, true, access, e.tcpClaim(m))
		if be, ok := reply.(*mux.BindError); ok && be.Code == mux.CodeSubdomainTaken {
			continue
		}
		return reply
	}
	return &mux.BindError{Code: mux.CodeSubdomainTaken, Message: "the edge has no free TCP port this token may hold; stop a TCP tunnel of this token, or ask its operator for more --tcp-ports"}
}

// freePorts returns the ports of the edge that policy allows and that no
// binding holds, in random order: one read of the registry.
func (e *Edge) freePorts(ctx context.Context, policy *TokenPolicy) ([]int, error) {
	bound, err := e.store.List(ctx)
	if err != nil {
		return nil, err
	}
	held := make(map[string]bool, len(bound))
	for _, b := range bound {
		held[b.Hostname] = true
	}
	var out []int
	for _, pr := range e.cfg.TCPPorts {
		for p := pr.Lo; p <= pr.Hi; p++ {
			if policy.allowsPort(p) && !held[mux.TCPKey(p)] {
				out = append(out, p)
			}
		}
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out, nil
}

// passthrough is the handshake's error for a ClientHello whose name is
// bound for TLS passthrough: the name.
type passthrough string

func (p passthrough) Error() string { return "edge: " + string(p) + " is passed through" }

// passthroughTLS is tc for the HTTPS listener: a ClientHello whose name is
// bound for TLS passthrough ends the handshake before any answer, with
// the passthrough error, so that the connection goes to the agent whole.
func (e *Edge) passthroughTLS(tc *tls.Config) *tls.Config {
	next := tc.GetConfigForClient
	tc.GetConfigForClient = func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		if host, err := NormalizeHost(h.ServerName); err == nil && host != "" {
			if b, ok, err := e.lookup(h.Context(), host); err == nil && ok && b.Proto == mux.ProtoTLS {
				return nil, passthrough(host)
			}
		}
		mux.EndPeek(h.Conn, false) // answered here: its writes go out
		if next != nil {
			return next(h)
		}
		return nil, nil
	}
	return tc
}
