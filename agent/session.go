package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/mux"
)

// Errors that end a session and are retried.
var (
	errHeartbeatTimeout = errors.New("agent: the edge did not answer heartbeats in time")
	errGoAway           = errors.New("agent: the edge is shutting down")
	errSessionClosed    = errors.New("agent: session closed")
)

// conn is one live session: the yamux session, its control stream and the
// exchanges on the edge's streams.
type conn struct {
	a    *Agent
	ys   *yamux.Session
	ctrl net.Conn
	id   uint64

	mu   sync.Mutex
	held map[string]*tunnel // the hostnames bound on this session

	writeMu sync.Mutex
	lastAck atomic.Int64 // unix nanoseconds of the last heartbeat answer

	hbMu   sync.Mutex
	hbSent [hbKept]sentBeat // the last heartbeats sent, by seq % hbKept

	events     chan error    // first session-ending event from the reader
	readerDone chan struct{} // closed when readControl returns
	unbound    chan string   // the hostnames the edge confirms unbound
	streams    mux.Tracker   // exchanges in flight, for the drain
	spare      bool          // the edge takes a spare stream (mux.FeatureSpareStream)
}

// runSession dials, binds and serves one session. healthy reports whether it
// got as far as a binding.
func (a *Agent) runSession(ctx context.Context, tc *tls.Config, takeover bool) (healthy bool, err error) {
	c, err := a.connect(ctx, tc, takeover)
	if err != nil {
		a.log.Debug("connect failed", "edge", a.cfg.Edge, "err", err)
		return false, err
	}
	err = c.run(ctx)
	if ctx.Err() != nil {
		a.stopGracefully(c)
		return true, nil
	}
	a.log.Debug("session ended", "session", c.id, "err", err)
	a.abandon(c)
	return true, err
}

// connect dials the edge and runs hello and bind, all within DialTimeout.
func (a *Agent) connect(ctx context.Context, tc *tls.Config, takeover bool) (*conn, error) {
	a.setStatus(func(s *Status) {
		if s.State != StateReconnecting {
			s.State = StateConnecting
		}
	})
	deadline := time.Now().Add(a.cfg.DialTimeout)
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	nc, err := dialTLS(dctx, a.cfg.Edge, tc, paceFor(a.latency()))
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", a.cfg.Edge, err)
	}
	yc, err := a.cfg.Mux.YamuxConn(nc, nil)
	if err != nil {
		nc.Close()
		return nil, err
	}
	ys, err := yamux.Client(mux.CoalesceWith(nc, mux.CoalesceConfig{WriteTimeout: yc.ConnectionWriteTimeout, Linger: closeLinger, SendBuffer: int(yc.MaxStreamWindowSize)}), yc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("yamux: %w", err)
	}
	c := &conn{a: a, ys: ys, held: map[string]*tunnel{}, events: make(chan error, 1),
		unbound: make(chan string, maxTunnels), readerDone: make(chan struct{})}
	if err := c.handshake(deadline, takeover); err != nil {
		ys.Close()
		return nil, err
	}
	return c, nil
}

// closeLinger bounds how long closing a session that met no error (a
// drained, abandoned or stopped one) waits for the edge to close its side
// after the agent's close_notify. Closing at once, with the edge's window
// updates or pings unread, would make the kernel send a reset and drop the
// tail of a response the network had not yet carried.
const closeLinger = time.Second

// dialTLS dials the edge, with TLS over a batched socket so that a
// transfer's records leave and arrive in few syscalls (mux.Batched).
func dialTLS(ctx context.Context, addr string, tc *tls.Config, p pace) (net.Conn, error) {
	d := &net.Dialer{KeepAlive: 15 * time.Second}
	raw, err := dialStaggered(ctx, p, func(ctx context.Context) (net.Conn, error) {
		return d.DialContext(ctx, "tcp", addr)
	})
	if err != nil {
		return nil, err
	}
	c := tls.Client(mux.Batched(raw), tc)
	if err := c.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, err
	}
	return c, nil
}

// A SYN that gets no answer is sent again after 1 s, and again and again
// (each second for the first four on Linux since 6.5, then doubling): a
// dial started while the network is down may wait seconds after it is
// back. So while no dial has connected, a fresh one starts every round
// trip (pace), and the first to connect is taken.
//
// Each dial but a connect's first is cancelled before the kernel would
// send its SYN again, so that every SYN on the wire is a fresh dial's: the
// agent sends one SYN per pace.every and the first dial's resends, at most
// about 21 a second whatever the path, so 1,000 agents behind an edge that
// went silent send it at most about 21,000 in all (with 250 ms and every
// dial kept, the rate grew with the dials waiting: 8, 12, 16, 20, 22 a
// second over a connect's first five seconds, measured). And the
// connection taken starts with the full initial congestion window: after
// a SYN sent a third time Linux starts it at one segment, and a TLS
// ClientHello with its post-quantum key share (1.5 KB, two segments) then
// costs a round trip more (BENCHMARKS.md, run 11). The first dial lives
// until the connect's deadline, so a path slower than it was measured
// still connects.
const (
	// redialMin is the closest spacing of fresh dials: on a LAN, spacing
	// them by the round trip would send thousands of SYNs a second.
	redialMin = 50 * time.Millisecond
	// redialMax is the spacing before any round trip was measured, and
	// the widest: the wait for a SYN after the network is back is at most
	// this.
	redialMax = 250 * time.Millisecond
	// dialLife is how long a fresh dial waits for its answer: under the
	// kernel's 1 s initial SYN timeout (TCP_TIMEOUT_INIT), so it never
	// sends a second SYN. On a path slower than dialLife/dialLifeRTTs
	// (225 ms) it waits dialLifeRTTs round trips instead.
	dialLife     = 900 * time.Millisecond
	dialLifeRTTs = 4
	// maxPendingDials bounds the sockets a connect holds at once; with
	// the bounds above it binds only on paths slower than about a second.
	maxPendingDials = 20
)

// pace spaces one connect's dials while none has connected.
type pace struct {
	every time.Duration // between fresh dials
	life  time.Duration // how long a dial after the first waits for an answer
	most  int           // dials pending at once
}

// paceFor is the pace for a path of round trip rtt, zero when none was
// measured yet.
func paceFor(rtt time.Duration) pace {
	p := pace{every: redialMax, life: max(dialLife, dialLifeRTTs*rtt), most: maxPendingDials}
	if rtt > 0 {
		p.every = min(max(rtt, redialMin), redialMax)
	}
	return p
}

// isTimeout reports whether err is a dial's deadline passing: the dialer
// may report it before the context's own timer has marked it done.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// errNoAnswer means no dial got an answer, not even a refusal, before the
// connect's deadline: the network, or the path to the edge, is silent.
var errNoAnswer = errors.New("agent: no answer from the edge's address")

// dialStaggered calls dial at once and again every p.every while none has
// connected and fewer than p.most wait, and returns the first connection.
// The first dial waits until ctx ends, each later one p.life. When it
// returns, the other dials are cancelled and waited for, and any that
// connected closed. A dial that fails fast (refused, unreachable) ends it
// with that error.
func dialStaggered(ctx context.Context, p pace, dial func(context.Context) (net.Conn, error)) (net.Conn, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		c       net.Conn
		err     error
		expired bool // its life, or the connect, ended it
	}
	results := make(chan result, p.most)
	pending := 0
	defer func() {
		cancel()
		for ; pending > 0; pending-- {
			if r := <-results; r.c != nil {
				r.c.Close()
			}
		}
	}()
	start := func(life time.Duration) {
		pending++
		dctx, dcancel := context.WithCancel(ctx)
		go func() {
			defer dcancel()
			if life > 0 {
				// A cancel, not a deadline: the dial returns only once
				// dctx is done, so its end is told from a fast failure.
				stop := time.AfterFunc(life, dcancel)
				defer stop.Stop()
			}
			c, err := dial(dctx)
			results <- result{c, err, err != nil && dctx.Err() != nil}
		}()
	}
	start(0)
	next := time.NewTicker(p.every)
	defer next.Stop()
	for {
		select {
		case <-next.C:
			if pending < p.most {
				start(p.life)
			}
		case r := <-results:
			pending--
			switch {
			case r.err == nil:
				return r.c, nil
			case r.expired || isTimeout(r.err):
				// Silence: its life or the connect's deadline ended it.
			default:
				return nil, r.err
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", errNoAnswer, context.Cause(ctx))
		}
	}
}

// handshake sends the hello and binds every tunnel. When no tunnel needs
// a feature the edge must confirm in its hello_ok, the binds follow the
// hello at once, without waiting for its answer: the edge reads them in
// order, so they cost no round trip of their own. A hello the edge refuses
// ends the session, binds unread.
func (c *conn) handshake(deadline time.Time, takeover bool) error {
	a := c.a
	ctrl, err := c.ys.OpenStream()
	if err != nil {
		return fmt.Errorf("open control stream: %w", err)
	}
	c.ctrl = ctrl
	ctrl.SetDeadline(deadline)
	defer ctrl.SetDeadline(time.Time{})
	sent := time.Now()
	if err := mux.Write(ctrl, &mux.Hello{Version: mux.Version, InstanceID: a.cfg.InstanceID, Token: a.cfg.Token, Agent: "ngstone"}); err != nil {
		return fmt.Errorf("hello: %w", err)
	}
	var bound []*tunnel
	early := len(a.needs()) == 0
	if early {
		if bound, err = c.sendBinds(takeover); err != nil {
			return err
		}
	}
	if err := c.readHelloOK(sent); err != nil {
		return err
	}
	if !early {
		if bound, err = c.sendBinds(takeover); err != nil {
			return err
		}
	}
	return c.bindAll(bound, takeover)
}

// readHelloOK reads the edge's answer to the hello sent at sent.
func (c *conn) readHelloOK(sent time.Time) error {
	a := c.a
	msg, err := mux.Read(c.ctrl)
	if err != nil {
		return fmt.Errorf("hello: %w", err)
	}
	switch m := msg.(type) {
	case *mux.HelloOK:
		// The first measure of the round trip, until a heartbeat's.
		a.setLatency(time.Since(sent))
		c.id = m.SessionID
		a.useResponseHeadLimit(m.MaxResponseHead)
		c.spare = slices.Contains(m.Features, mux.FeatureSpareStream)
		return a.edgeDoes(m.Features)
	case *mux.Error:
		if mux.Retryable(m.Code) {
			return &retryError{err: fmt.Errorf("hello: %s", m.Message), after: time.Duration(m.RetryAfterMS) * time.Millisecond}
		}
		return &RefusedError{Code: m.Code, Message: m.Message}
	default:
		return fmt.Errorf("hello: unexpected %s", msg.MessageType())
	}
}

// sendBinds sends a bind for every tunnel whose name is not gone for good,
// with takeover after a reconnect, and returns those tunnels in order.
func (c *conn) sendBinds(takeover bool) ([]*tunnel, error) {
	a := c.a
	var sent []*tunnel
	for _, t := range a.tunnels {
		a.mu.Lock()
		gone, name := t.final(), t.ask
		a.mu.Unlock()
		if gone {
			continue
		}
		bind := &mux.Bind{Subdomain: name, Takeover: takeover, AllowCIDR: t.cfg.AllowCIDR, DenyCIDR: t.cfg.DenyCIDR}
		if t.cfg.Hostname != "" {
			bind.Subdomain, bind.Hostname = "", t.cfg.Hostname
		}
		if err := mux.Write(c.ctrl, bind); err != nil {
			return nil, t.wrap(fmt.Errorf("bind: %w", err))
		}
		sent = append(sent, t)
	}
	return sent, nil
}

// bindAll reads the answers to the binds of sent, in order. A tunnel
// refused (or whose name another agent took) is left out from then on and
// the others are bound; the session fails only when a bind fails in a way
// worth retrying, or when no tunnel is left.
func (c *conn) bindAll(sent []*tunnel, takeover bool) error {
	a := c.a
	bound := 0
	for _, t := range sent {
		err := c.bound(t, takeover)
		var re *RefusedError
		switch {
		case err == nil:
			bound++
		case errors.Is(err, ErrEvicted) || errors.As(err, &re):
			a.lose(t, err)
		default:
			return t.wrap(err)
		}
	}
	if bound == 0 {
		return a.noneLeft()
	}
	a.setStatus(func(s *Status) {
		s.State, s.SessionID, s.Attempt, s.NextRetry, s.Err, s.Hint = StateOnline, c.id, 0, time.Time{}, nil, ""
	})
	return nil
}

// bound reads the edge's answer to t's bind.
func (c *conn) bound(t *tunnel, takeover bool) error {
	a := c.a
	a.mu.Lock()
	held := t.st.Hostname != ""
	a.mu.Unlock()
	msg, err := mux.Read(c.ctrl)
	if err != nil {
		return fmt.Errorf("bind: %w", err)
	}
	switch m := msg.(type) {
	case *mux.BindOK:
		c.mu.Lock()
		c.held[m.Hostname] = t
		c.mu.Unlock()
		a.mu.Lock()
		a.hosts[m.Hostname] = t
		if t.cfg.Hostname == "" {
			t.ask = label(m.Hostname) // a random name is kept for the rebinds
		}
		t.st.State, t.st.Hostname, t.st.URL, t.st.URLs, t.st.Generation, t.st.Err = TunnelOnline, m.Hostname, m.URL, m.URLs, m.Generation, nil
		a.mu.Unlock()
		t.log.Debug("online", "url", m.URL, "generation", m.Generation, "session", c.id, "takeover", takeover)
		return nil
	case *mux.BindError:
		if mux.Retryable(m.Code) {
			return fmt.Errorf("bind: %s", m.Message)
		}
		if m.Code == mux.CodeSubdomainTaken && held {
			// The name this agent held is another instance's now: taken
			// over while this one was away, after the edge had closed its
			// silent session (so no evicted reached it).
			return newEvictedError(m.Code, m.By)
		}
		return &RefusedError{Code: m.Code, Message: m.Message}
	}
	return fmt.Errorf("bind: unexpected %s", msg.MessageType())
}

// lose marks t's name as gone for good, for err (refused, or evicted).
func (a *Agent) lose(t *tunnel, err error) {
	a.mu.Lock()
	var ee *evictedError
	if errors.As(err, &ee) {
		t.st.State, t.st.EvictedReason, t.st.EvictedBy, t.st.URL, t.st.URLs = TunnelEvicted, ee.reason, ee.by, "", nil
	} else {
		t.st.State = TunnelRefused
	}
	t.st.Err = err
	// Its hostname routes nothing here any more.
	maps.DeleteFunc(a.hosts, func(_ string, o *tunnel) bool { return o == t })
	left := 0
	for _, o := range a.tunnels {
		if !o.final() {
			left++
		}
	}
	a.mu.Unlock()
	if len(a.tunnels) > 1 {
		what := "refused by the edge"
		if ee != nil {
			what = "taken over by another agent"
		}
		t.log.Warn("tunnel "+what, "err", err, "tunnels_left", left)
		a.setStatus(func(*Status) {})
	}
}

// noneLeft is the final error of an agent whose every tunnel is gone: an
// eviction if a name was taken over, else the first refusal.
func (a *Agent) noneLeft() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var refused error
	for _, t := range a.tunnels {
		if t.st.State == TunnelEvicted {
			return t.st.Err
		}
		if refused == nil {
			refused = t.st.Err
		}
	}
	if refused == nil {
		refused = errors.New("agent: no tunnel")
	}
	return refused
}

// needs is what the agent's settings need the edge to do, by feature:
// an older edge would bind another name than --hostname asks, or let in
// visitors --allow-cidr keeps out.
func (a *Agent) needs() map[string]string {
	need := map[string]string{}
	for _, t := range a.tunnels {
		if t.cfg.Hostname != "" {
			need[mux.FeatureHostname] = "--hostname"
		}
		if len(t.cfg.AllowCIDR)+len(t.cfg.DenyCIDR) > 0 {
			need[mux.FeatureVisitorCIDR] = "--allow-cidr and --deny-cidr"
		}
	}
	return need
}

// edgeDoes checks that the edge does what this agent's settings need.
func (a *Agent) edgeDoes(features []string) error {
	for f, flag := range a.needs() {
		if !slices.Contains(features, f) {
			return &RefusedError{Code: "unsupported", Message: "this edge does not support " + flag + ": upgrade the edge, or run without"}
		}
	}
	return nil
}

// run serves the session until ctx ends or the session ends.
func (c *conn) run(ctx context.Context) error {
	a := c.a
	c.lastAck.Store(time.Now().UnixNano())
	a.wg.Add(2)
	go func() {
		defer a.wg.Done()
		c.serveStreams()
	}()
	go func() {
		defer a.wg.Done()
		defer close(c.readerDone)
		c.readControl()
	}()
	return c.heartbeat(ctx)
}

// heartbeat sends heartbeats and watches their answers until the session
// ends. The check runs more often than the heartbeat so a dead path is seen
// within a fraction of HeartbeatTimeout after it expires.
func (c *conn) heartbeat(ctx context.Context) error {
	a := c.a
	send := time.NewTicker(a.cfg.HeartbeatInterval)
	defer send.Stop()
	check := time.NewTicker(max(a.cfg.HeartbeatTimeout/10, time.Millisecond))
	defer check.Stop()
	var seq uint64
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-c.events:
			return err
		case <-c.ys.CloseChan():
			// The edge may have said why (evicted) just before closing:
			// let the reader finish what arrived.
			<-c.readerDone
			select {
			case err := <-c.events:
				if errors.Is(err, ErrEvicted) || errors.Is(err, errGoAway) {
					return err
				}
			default:
			}
			return errSessionClosed
		case <-send.C:
			seq++
			c.hbMu.Lock()
			c.hbSent[seq%hbKept] = sentBeat{seq: seq, at: time.Now()}
			c.hbMu.Unlock()
			if err := c.send(&mux.Heartbeat{Seq: seq}, a.cfg.HeartbeatInterval); err != nil {
				return fmt.Errorf("heartbeat: %w", err)
			}
		case now := <-check.C:
			if now.Sub(time.Unix(0, c.lastAck.Load())) > a.cfg.HeartbeatTimeout {
				return errHeartbeatTimeout
			}
		}
	}
}

// readControl handles the edge's control messages. Its events reach run only
// while this session is current: once abandoned, nobody reads c.events.
func (c *conn) readControl() {
	for {
		msg, err := mux.Read(c.ctrl)
		if err != nil {
			c.event(fmt.Errorf("control stream: %w", err))
			return
		}
		switch m := msg.(type) {
		case *mux.HeartbeatAck:
			c.lastAck.Store(time.Now().UnixNano())
			c.measure(m.Seq)
		case *mux.Evicted:
			c.evicted(m)
		case *mux.GoAway:
			c.event(errGoAway)
		case *mux.Unbound:
			select {
			case c.unbound <- m.Hostname:
			default:
			}
		}
	}
}

// evicted handles the edge's word that another session took a hostname:
// that tunnel's name is gone; the session ends when no tunnel is left.
func (c *conn) evicted(m *mux.Evicted) {
	c.mu.Lock()
	t := c.held[m.Hostname]
	delete(c.held, m.Hostname)
	c.mu.Unlock()
	if t == nil {
		return
	}
	err := newEvictedError(m.Reason, m.By)
	t.log.Debug("evicted", "hostname", m.Hostname, "reason", m.Reason, "by", err.by.String(), "session", c.id)
	c.a.lose(t, err)
	c.mu.Lock()
	left := len(c.held)
	c.mu.Unlock()
	if left == 0 {
		c.event(err)
	}
}

// hbKept is how many heartbeats' send times a session keeps: a path
// slower than that many heartbeat intervals is measured no more (its
// heartbeat timeout is near).
const hbKept = 16

type sentBeat struct {
	seq uint64
	at  time.Time
}

// measure takes the round trip of heartbeat seq, from when it was sent.
func (c *conn) measure(seq uint64) {
	c.hbMu.Lock()
	b := c.hbSent[seq%hbKept]
	c.hbMu.Unlock()
	if b.seq == seq && !b.at.IsZero() {
		c.a.setLatency(time.Since(b.at))
	}
}

func (c *conn) event(err error) {
	select {
	case c.events <- err:
	default:
	}
}

func (c *conn) send(m mux.Message, timeout time.Duration) error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	c.ctrl.SetWriteDeadline(time.Now().Add(timeout))
	defer c.ctrl.SetWriteDeadline(time.Time{})
	return mux.Write(c.ctrl, m)
}

// stopGracefully unbinds every name (the edge stops routing them at once),
// lets in-flight requests finish within DrainTimeout, then closes the
// session.
func (a *Agent) stopGracefully(c *conn) {
	c.mu.Lock()
	held := slices.Sorted(maps.Keys(c.held))
	c.mu.Unlock()
	a.log.Info("stopping: unbinding", "hostnames", held)
	t := time.NewTimer(a.cfg.DialTimeout)
	defer t.Stop()
	waiting := map[string]bool{}
	for _, h := range held {
		if err := c.send(&mux.Unbind{Hostname: h}, a.cfg.DialTimeout); err != nil {
			break
		}
		waiting[h] = true
	}
	for len(waiting) > 0 {
		select {
		case h := <-c.unbound:
			delete(waiting, h)
		case <-c.ys.CloseChan():
			waiting = nil
		case <-t.C:
			waiting = nil
		}
	}
	c.drain()
}

// abandon leaves a broken or evicted session to finish its accepted requests
// in the background, then closes it.
func (a *Agent) abandon(c *conn) {
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		c.drain()
	}()
}

// drain waits until the session's exchanges are done or DrainTimeout has
// passed, then closes the session. The session keeps accepting streams until
// then, so a request the edge routes here before it learns of a takeover is
// still answered.
func (c *conn) drain() {
	ctx, cancel := context.WithTimeout(context.Background(), c.a.cfg.DrainTimeout)
	defer cancel()
	c.streams.Wait(ctx, c.ys.CloseChan())
	c.ys.Close() // ends serveStreams; a running exchange ends at its next stream read or write, or its watcher
}

// serveStreams relays each stream the edge opens, one exchange each, until
// the session closes. An exchange holds up the drain from accept to its
// end; an upgraded one no longer does.
func (c *conn) serveStreams() {
	var ln net.Listener = sessionListener{c.ys}
	if c.spare {
		ln = spareListener{sessionListener{c.ys}}
	}
	c.a.serveStreams(ln, &c.streams)
}

// sessionListener accepts the edge's streams; the session's owner closes it.
type sessionListener struct{ ys *yamux.Session }

func (l sessionListener) Accept() (net.Conn, error) { return l.ys.AcceptStream() }
func (l sessionListener) Close() error              { return nil }
func (l sessionListener) Addr() net.Addr            { return l.ys.Addr() }

// AcceptContext is Accept that also ends with ctx.
func (l sessionListener) AcceptContext(ctx context.Context) (net.Conn, error) {
	st, err := l.ys.AcceptStreamWithContext(ctx)
	if err != nil {
		return nil, err
	}
	return st, nil
}

// spareListener is the listener of a session whose edge takes a spare
// stream from the agent (mux.FeatureSpareStream).
type spareListener struct{ sessionListener }

func (l spareListener) OpenSpare() (net.Conn, error) { return l.ys.OpenStream() }
