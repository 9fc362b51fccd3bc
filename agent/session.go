package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
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
	raw  net.Conn // the TCP socket beneath
	ctrl net.Conn
	id   uint64

	// What the handshake learnt, which adopt makes the agent's.
	binding  bool        // it holds its connect's binding slot
	takeover bool        // its binds asked to take names over
	maxHead  int64       // the edge's limit on a response head
	answers  []bindReply // the edge's answer to each bind, in order

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
	accepted   atomic.Int64  // streams the server accepted and has not closed
}

// runSession dials, binds and serves one session. healthy reports whether it
// got as far as a binding.
func (a *Agent) runSession(ctx context.Context, tc *tls.Config, takeover bool) (healthy bool, err error) {
	c, err := a.connect(ctx, tc, takeover)
	if err != nil {
		a.log.Debug("connect failed", "edge", a.cfg.Edge, "err", err)
		return false, err
	}
	a.current.Store(c)
	c.tellDown()
	err = c.run(ctx)
	a.current.CompareAndSwap(c, nil)
	if ctx.Err() != nil {
		a.stopGracefully(c)
		return true, nil
	}
	a.log.Debug("session ended", "session", c.id, "err", err)
	a.abandon(c)
	return true, err
}

// connect reaches the edge within DialTimeout: staggered attempts, each
// a whole connection (TCP, TLS, hello, binds), of which the first to
// finish its binds becomes the session.
func (a *Agent) connect(ctx context.Context, tc *tls.Config, takeover bool) (*conn, error) {
	a.setStatus(func(s *Status) {
		if s.State != StateReconnecting {
			s.State = StateConnecting
		}
	})
	ctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
	defer cancel()
	binding := make(chan struct{}, 1)
	var n atomic.Int64
	c, err := staggered(ctx, paceFor(a.latency()), func(ctx context.Context) (*conn, error) {
		return a.attempt(ctx, tc, takeover, binding, int(n.Add(1)-1))
	})
	if errors.Is(err, errNoAnswer) {
		return nil, fmt.Errorf("dial %s: %w", a.cfg.Edge, err)
	}
	if err != nil {
		return nil, err
	}
	if err := c.adopt(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// attempt is the n-th of a connect's attempts; it ends when ctx does. It
// sends binds only while it holds binding, which it keeps if it returns a
// conn.
func (a *Agent) attempt(ctx context.Context, tc *tls.Config, takeover bool, binding chan struct{}, n int) (*conn, error) {
	raw, err := dialEdge(ctx, a.cfg.Edge, n, net.DefaultResolver.LookupHost)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", a.cfg.Edge, err)
	}
	// Closing the socket ends the attempt at whichever step it is.
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	c, err := a.open(ctx, raw, tc)
	if err == nil {
		err = c.handshake(ctx, takeover, binding)
	}
	if !stop() && err == nil {
		err = context.Cause(ctx)
	}
	if err != nil {
		raw.Close()
		if c != nil {
			c.ys.Close()
			if c.binding {
				<-binding
			}
		}
		return nil, err
	}
	return c, nil
}

// open runs the TLS handshake on raw, with TLS over a batched socket so
// that a transfer's records leave and arrive in few syscalls
// (mux.Batched), and starts the yamux session.
func (a *Agent) open(ctx context.Context, raw net.Conn, tc *tls.Config) (*conn, error) {
	nc := tls.Client(mux.Batched(raw), tc)
	if err := nc.HandshakeContext(ctx); err != nil {
		return nil, fmt.Errorf("dial %s: %w", a.cfg.Edge, err)
	}
	yc, err := a.cfg.Mux.YamuxConn(nc, nil)
	if err != nil {
		return nil, err
	}
	ys, err := yamux.Client(mux.CoalesceWith(nc, mux.CoalesceConfig{WriteTimeout: yc.ConnectionWriteTimeout, Linger: closeLinger, SendBuffer: int(yc.MaxStreamWindowSize)}), yc)
	if err != nil {
		return nil, fmt.Errorf("yamux: %w", err)
	}
	return &conn{a: a, ys: ys, raw: raw, held: map[string]*tunnel{}, events: make(chan error, 1),
		unbound: make(chan string, maxTunnels), readerDone: make(chan struct{})}, nil
}

// dialEdge dials addr, the edge. A name of several addresses (edges behind
// round-robin DNS) is dialed from its n-th address on, each in turn until
// one connects: each attempt of a connect starts at the next, so an edge
// that accepts and then says nothing (stopped, or a dead backend behind a
// balancer) holds up only the attempts that start there.
func dialEdge(ctx context.Context, addr string, n int, lookup func(context.Context, string) ([]string, error)) (net.Conn, error) {
	d := &net.Dialer{KeepAlive: 15 * time.Second}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if net.ParseIP(host) != nil {
		return d.DialContext(ctx, "tcp", addr)
	}
	ips, err := lookup(ctx, host)
	if err != nil {
		return nil, err
	}
	var first error
	for i := range ips {
		c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(ips[(n+i)%len(ips)], port))
		if err == nil || ctx.Err() != nil {
			return c, err
		}
		if first == nil {
			first = err
		}
	}
	if first == nil {
		first = fmt.Errorf("%s has no address", host)
	}
	return nil, first
}

// Close ends a session that never served: its socket at once, as nothing
// it carries is owed an answer.
func (c *conn) Close() error {
	c.raw.Close()
	return c.ys.Close()
}

// closeLinger bounds how long closing a session that met no error (a
// drained, abandoned or stopped one) waits for the edge to close its side
// after the agent's close_notify. Closing at once, with the edge's window
// updates or pings unread, would make the kernel send a reset and drop the
// tail of a response the network had not yet carried.
const closeLinger = time.Second

// A silent path (SYNs unanswered, or a connection whose handshake a
// stopped edge's kernel or a balancer completed and that carries nothing)
// must not hold a connect until its DialTimeout once the path is back: so
// while no attempt has finished, a fresh one, a whole connect, starts
// every few round trips (pace), and the first to finish its binds wins.
// Each attempt but the first is given up before the kernel would send its
// SYN again, so the one taken starts with a full congestion window. Only
// one attempt at a time has binds out (conn.handshake): a loser's bind
// granted after the winner's would evict it.
const (
	// restartMin is the closest spacing of fresh attempts: on a LAN a few
	// round trips are less than the edge's registry takes to bind.
	restartMin = 250 * time.Millisecond
	// restartMax is the spacing before any round trip was measured, and
	// the widest.
	restartMax  = time.Second
	restartRTTs = 4
	// attemptLife is how long an attempt after the first may take; on a
	// path slower than attemptLife/attemptLifeRTTs it has that many round
	// trips instead.
	attemptLife     = 900 * time.Millisecond
	attemptLifeRTTs = 4
	// maxAttempts bounds the sockets a connect holds at once: the first
	// and the four a 900 ms life spans at 250 ms; it binds only on paths
	// slower than about a second. An agent opens at most one connection
	// per restartMin, 4 a second: 1,000 agents 4,000 a second.
	maxAttempts = 5
)

// pace spaces one connect's attempts while none has finished.
type pace struct {
	every time.Duration // between fresh attempts
	life  time.Duration // how long an attempt after the first may take
	most  int           // attempts pending at once
}

// paceFor is the pace for a path of round trip rtt, zero when none was
// measured yet.
func paceFor(rtt time.Duration) pace {
	p := pace{every: restartMax, life: max(attemptLife, attemptLifeRTTs*rtt), most: maxAttempts}
	if rtt > 0 {
		p.every = min(max(restartRTTs*rtt, restartMin), restartMax)
	}
	return p
}

// isTimeout reports whether err is an attempt's deadline passing: the
// dialer may report it before the context's own timer has marked it done.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// errNoAnswer means no attempt finished, or failed, before the connect's
// deadline: the network, or the path to the edge, is silent.
var errNoAnswer = errors.New("agent: no answer from the edge's address")

// staggered calls attempt at once and again every p.every while none has
// finished and fewer than p.most wait, and returns the first to succeed.
// The first attempt lasts until ctx ends, each later one p.life. When it
// returns, the other attempts are cancelled and waited for, and any that
// succeeded closed. An attempt that fails fast (refused, unreachable, an
// edge's refusal) ends it with that error.
func staggered[T io.Closer](ctx context.Context, p pace, attempt func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		c       T
		err     error
		expired bool // its life, or the connect, ended it
	}
	results := make(chan result, p.most)
	pending := 0
	defer func() {
		cancel()
		for ; pending > 0; pending-- {
			if r := <-results; r.err == nil {
				r.c.Close()
			}
		}
	}()
	start := func(life time.Duration) {
		pending++
		actx, acancel := context.WithCancel(ctx)
		go func() {
			defer acancel()
			if life > 0 {
				// A cancel, not a deadline: the attempt returns only once
				// actx is done, so its end is told from a fast failure.
				stop := time.AfterFunc(life, acancel)
				defer stop.Stop()
			}
			c, err := attempt(actx)
			results <- result{c, err, err != nil && actx.Err() != nil}
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
				var zero T
				return zero, r.err
			}
		case <-ctx.Done():
			var zero T
			return zero, fmt.Errorf("%w: %w", errNoAnswer, context.Cause(ctx))
		}
	}
}

// handshake sends the hello and binds every tunnel, and reads the edge's
// answers. When no tunnel needs a feature the edge must confirm in its
// hello_ok, the binds follow the hello at once, without waiting for its
// answer: the edge reads them in order, so they cost no round trip of
// their own. A hello the edge refuses ends the session, binds unread.
// The binds go out only once the attempt holds binding: the edge gives a
// name to the later of two binds of an instance, so a second attempt's
// binds, answered after the first's, would take the name from the
// attempt that won.
func (c *conn) handshake(ctx context.Context, takeover bool, binding chan struct{}) error {
	a := c.a
	ctrl, err := c.ys.OpenStream()
	if err != nil {
		return fmt.Errorf("open control stream: %w", err)
	}
	c.ctrl, c.takeover = ctrl, takeover
	sent := time.Now()
	if err := mux.Write(ctrl, &mux.Hello{Version: mux.Version, InstanceID: a.cfg.InstanceID, Token: a.cfg.Token, Agent: "ngstone"}); err != nil {
		return fmt.Errorf("hello: %w", err)
	}
	early := len(a.needs()) == 0
	if !early {
		if err := c.readHelloOK(sent); err != nil {
			return err
		}
	}
	select {
	case binding <- struct{}{}:
		c.binding = true
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	sentBinds, err := c.sendBinds()
	if err != nil {
		return err
	}
	if early {
		if err := c.readHelloOK(sent); err != nil {
			return err
		}
	}
	return c.readBinds(sentBinds)
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
		c.id, c.maxHead = m.SessionID, m.MaxResponseHead
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
func (c *conn) sendBinds() ([]*tunnel, error) {
	a := c.a
	var sent []*tunnel
	for _, t := range a.tunnels {
		a.mu.Lock()
		gone, name, port := t.final(), t.ask, t.askPort
		a.mu.Unlock()
		if gone {
			continue
		}
		bind := &mux.Bind{Subdomain: name, Takeover: c.takeover, AllowCIDR: t.cfg.AllowCIDR, DenyCIDR: t.cfg.DenyCIDR}
		bind.Webhook, bind.OAuth, bind.Pool = t.cfg.webhook(), t.cfg.oauth(), t.cfg.Pool
		switch {
		case t.cfg.isTCP():
			bind.Subdomain, bind.Proto, bind.Port, bind.Label = "", mux.ProtoTCP, port, t.cfg.label()
		case t.cfg.Hostname != "":
			bind.Subdomain, bind.Hostname = "", t.cfg.Hostname
		}
		if t.cfg.Proto == ProtoTLS {
			bind.Proto = mux.ProtoTLS
		}
		if err := mux.Write(c.ctrl, bind); err != nil {
			return nil, t.wrap(fmt.Errorf("bind: %w", err))
		}
		sent = append(sent, t)
	}
	return sent, nil
}

// bindReply is the edge's answer to one tunnel's bind: the name granted,
// or why it is gone for good (refused, or another agent's).
type bindReply struct {
	t    *tunnel
	ok   *mux.BindOK
	lost error
}

// readBinds reads the answers to the binds of sent, in order. The attempt
// fails only when a bind fails in a way worth retrying.
func (c *conn) readBinds(sent []*tunnel) error {
	for _, t := range sent {
		r, err := c.bound(t)
		if err != nil {
			return t.wrap(err)
		}
		c.answers = append(c.answers, r)
	}
	return nil
}

// bound reads the edge's answer to t's bind.
func (c *conn) bound(t *tunnel) (bindReply, error) {
	a := c.a
	a.mu.Lock()
	held := t.st.Hostname != ""
	a.mu.Unlock()
	msg, err := mux.Read(c.ctrl)
	if err != nil {
		return bindReply{}, fmt.Errorf("bind: %w", err)
	}
	switch m := msg.(type) {
	case *mux.BindOK:
		return bindReply{t: t, ok: m}, nil
	case *mux.BindError:
		if mux.Retryable(m.Code) {
			return bindReply{}, fmt.Errorf("bind: %s", m.Message)
		}
		if m.Code == mux.CodeSubdomainTaken && held {
			// The name this agent held is another instance's now: taken
			// over while this one was away, after the edge had closed its
			// silent session (so no evicted reached it).
			return bindReply{t: t, lost: newEvictedError(m.Code, m.By)}, nil
		}
		return bindReply{t: t, lost: &RefusedError{Code: m.Code, Message: m.Message}}, nil
	}
	return bindReply{}, fmt.Errorf("bind: unexpected %s", msg.MessageType())
}

// adopt makes c the agent's session: each tunnel bound, or left out from
// then on when refused (or its name another agent's). It fails when no
// tunnel is left.
func (c *conn) adopt() error {
	a := c.a
	a.useResponseHeadLimit(c.maxHead)
	bound := 0
	for _, r := range c.answers {
		if r.ok == nil {
			a.lose(r.t, r.lost)
			continue
		}
		c.take(r.t, r.ok)
		bound++
	}
	if bound == 0 {
		return a.noneLeft()
	}
	a.setStatus(func(s *Status) {
		s.State, s.SessionID, s.Attempt, s.NextRetry, s.Err, s.Hint = StateOnline, c.id, 0, time.Time{}, nil, ""
	})
	return nil
}

// take records the name m granted to t on this session.
func (c *conn) take(t *tunnel, m *mux.BindOK) {
	a := c.a
	c.mu.Lock()
	c.held[m.Hostname] = t
	c.mu.Unlock()
	a.mu.Lock()
	a.hosts[m.Hostname] = t
	switch port, tcp := mux.ParseTCPKey(m.Hostname); {
	case tcp:
		t.askPort = port // the port given is asked for again on rebinds
	case t.cfg.Hostname == "":
		t.ask = label(m.Hostname) // a random name is kept for the rebinds
	}
	t.st.State, t.st.Hostname, t.st.URL, t.st.URLs, t.st.Generation, t.st.Err = TunnelOnline, m.Hostname, m.URL, m.URLs, m.Generation, nil
	a.mu.Unlock()
	t.log.Debug("online", "url", m.URL, "generation", m.Generation, "session", c.id, "takeover", c.takeover)
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
		if t.cfg.VerifyWebhook != "" {
			need[mux.FeatureWebhook] = "--verify-webhook"
		}
		if t.cfg.OAuth != "" {
			need[mux.FeatureOAuth] = "--oauth"
		}
		if t.cfg.Pool {
			need[mux.FeaturePool] = "--pool"
		}
		switch t.cfg.Proto {
		case ProtoTCP:
			need[mux.FeatureTCP] = "TCP tunnels"
		case ProtoTLS:
			need[mux.FeatureTLS] = "TLS passthrough"
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
		case *mux.Refused:
			c.refused(m)
		case *mux.Unbound:
			select {
			case c.unbound <- m.Hostname:
			default:
			}
		}
	}
}

// refused lists a request the edge refused for one of this session's
// tunnels, and logs it.
func (c *conn) refused(m *mux.Refused) {
	c.mu.Lock()
	t := c.held[m.Hostname]
	c.mu.Unlock()
	if t == nil {
		return
	}
	t.log.Info("request refused at the edge", "code", m.Code, "method", m.Method, "path", m.Path, "reason", m.Reason)
	if in := c.a.inspect; in != nil {
		in.addRefused(t, m)
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
// still answered: a stream the edge opened before its notice may still wait
// for the server's accept when the notice is read, and the drain waits up to
// newStreamGrace for it, as it counts only from the accept.
func (c *conn) drain() {
	ctx, cancel := context.WithTimeout(context.Background(), c.a.cfg.DrainTimeout)
	defer cancel()
	lag := time.NewTimer(newStreamGrace)
	defer lag.Stop()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for waiting := true; waiting; {
		c.streams.Wait(ctx, c.ys.CloseChan())
		if ctx.Err() != nil || c.ys.IsClosed() {
			break
		}
		// Every stream open but the control stream is one the server
		// accepted (counted after the drain's count), or one it is about to
		// (or one closed here whose close the edge has yet to answer: the
		// wait is bounded).
		if int64(c.ys.NumStreams()) <= c.accepted.Load()+1 {
			if c.streams.Count() == 0 {
				break
			}
			continue // one accepted since the wait holds the drain
		}
		select {
		case <-tick.C:
		case <-lag.C:
			waiting = false
		}
	}
	c.ys.Close() // ends serveStreams; a running exchange ends at its next stream read or write, or its watcher
}

// serveStreams relays the exchanges of each stream the edge opens until
// the session closes. An exchange holds up the drain from its request to
// its end; an idle stream or an upgraded one does not.
func (c *conn) serveStreams() {
	c.a.serveStreams(sessionListener{c.ys}, &c.streams, &c.accepted)
}

// sessionListener accepts the edge's streams; the session's owner closes it.
type sessionListener struct{ ys *yamux.Session }

func (l sessionListener) Accept() (net.Conn, error) { return l.ys.AcceptStream() }
func (l sessionListener) Close() error              { return nil }
func (l sessionListener) Addr() net.Addr            { return l.ys.Addr() }
