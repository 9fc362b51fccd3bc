package edge

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/time/rate"

	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// maxAgentStreams is how many streams an agent may try to open towards the
// edge, beyond its control stream, before its session is closed.
const maxAgentStreams = 3

// closedStreamWait is how long a stream the edge has closed waits for the
// agent's close before yamux resets it. The edge reads nothing of a stream
// after closing it, at a response's end or when its visitor left; until
// the stream is closed on both sides yamux keeps what the agent still
// sends into its window, unread. A visitor who leaves a download would
// otherwise leave a window (up to 8 MiB) held for yamux's default of five
// minutes, and the agent blocked writing it, however many times over; the
// reset also ends the agent's write.
const closedStreamWait = time.Second

// controlWriteTimeout bounds one write on a control stream.
const controlWriteTimeout = 10 * time.Second

// session is one agent connection: a yamux session and its control stream.
type session struct {
	e    *Edge
	id   uint64
	ys   *yamux.Session
	pool *http.Transport // the streams kept open for exchanges
	// refusals bounds the refused notices sent to the agent (tellRefused).
	refusals *rate.Limiter
	remote   string
	log      *slog.Logger

	ctrl       net.Conn
	instanceID string
	tokenID    string
	policy     *TokenPolicy
	hello      atomic.Bool
	lastBeat   atomic.Int64 // unix nanoseconds
	streams    mux.Tracker  // exchanges in flight

	writeMu sync.Mutex
	// bindMu is held from a bind's registry grant to its reply, and by an
	// eviction notice: the agent never hears that a generation was taken
	// over before it heard that it was granted.
	bindMu sync.Mutex

	mu       sync.Mutex
	bindings map[string]uint64         // hostname -> generation this session holds
	access   map[string]*visitorAccess // hostname -> who may visit it; nil: anyone
	fenced   map[string]uint64         // hostname -> highest generation taken from it
	members  map[string]*memberState   // hostname -> its part in the name's pool
	draining bool

	closeOnce sync.Once
	closed    chan struct{}
}

// acceptAgents accepts control connections until the listener closes;
// accept errors are retried with a backoff (acceptLoop).
func (e *Edge) acceptAgents(ctx context.Context) {
	defer e.wg.Done()
	acceptLoop(e.ctrlLn, e.log, func() { e.metrics.acceptFailed("control") }, func(c net.Conn) {
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.handleAgent(ctx, c)
		}()
	})
}

// handleAgent runs one agent connection from TLS handshake to close.
func (e *Edge) handleAgent(ctx context.Context, c net.Conn) {
	if until, answer, banned := e.auth.banned(c.RemoteAddr().String(), time.Now()); banned {
		e.metrics.limited(limitAuthBan)
		if answer {
			e.refuseBanned(ctx, c, until)
		}
		c.Close()
		return
	}
	s, err := e.openSession(ctx, c)
	if err != nil {
		e.log.Debug("agent connection refused", "remote", c.RemoteAddr().String(), "err", err)
		c.Close()
		return
	}
	defer e.endSession(s)
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		s.acceptAgentStreams()
	}()
	s.readControl(ctx)
}

// refuseBanned tells the agent on c, inside TLS, that its address is
// refused for failed hellos and when it may try again: a valid agent
// behind the same address learns why, instead of seeing its connection
// close. It costs a TLS handshake, at most once every banAnswerEvery per
// address; other connections from it are closed before TLS.
func (e *Edge) refuseBanned(ctx context.Context, c net.Conn, until time.Time) {
	deadline := time.Now().Add(e.cfg.HelloTimeout)
	hctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if err := handshake(hctx, c); err != nil {
		return
	}
	yc, err := e.cfg.Mux.Yamux(nil)
	if err != nil {
		return
	}
	ys, err := yamux.Server(mux.Coalesce(c), yc)
	if err != nil {
		return
	}
	s := &session{e: e, ys: ys, closed: make(chan struct{})}
	defer s.lingerClose()
	ctrl, err := ys.AcceptStreamWithContext(hctx)
	if err != nil {
		return
	}
	s.ctrl = ctrl
	wait := time.Until(until).Round(time.Second)
	s.send(&mux.Error{Code: mux.CodeTooManyFailures, RetryAfterMS: time.Until(until).Milliseconds(),
		Message: fmt.Sprintf("this address made too many hellos with a token the edge does not accept; it is refused until %s (in %s): check --authtoken", until.UTC().Format(time.TimeOnly), wait)})
}

// handshake runs c's TLS handshake within ctx, when c is a TLS connection.
func handshake(ctx context.Context, c net.Conn) error {
	if tc, ok := c.(interface {
		HandshakeContext(context.Context) error
	}); ok {
		return tc.HandshakeContext(ctx)
	}
	return nil
}

// openSession runs the TLS handshake, the yamux server and the hello, all
// within HelloTimeout.
func (e *Edge) openSession(ctx context.Context, c net.Conn) (*session, error) {
	deadline := time.Now().Add(e.cfg.HelloTimeout)
	hctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if err := handshake(hctx, c); err != nil {
		return nil, fmt.Errorf("tls handshake: %w", err)
	}
	yc, err := e.cfg.Mux.YamuxConn(c, nil)
	if err != nil {
		return nil, err
	}
	yc.StreamCloseTimeout = closedStreamWait
	ys, err := yamux.Server(mux.CoalesceWith(c, mux.CoalesceConfig{SendBuffer: int(yc.MaxStreamWindowSize)}), yc)
	if err != nil {
		return nil, fmt.Errorf("yamux: %w", err)
	}
	s := &session{
		e: e, id: e.nextSession.Add(1), ys: ys, remote: c.RemoteAddr().String(),
		bindings: make(map[string]uint64), closed: make(chan struct{}),
		refusals: rate.NewLimiter(refusedPerSecond, refusedBurst),
	}
	s.pool = s.newPool()
	s.log = e.log.With("session", s.id, "remote", s.remote)
	if err := s.handshake(hctx, deadline); err != nil {
		s.lingerClose()
		return nil, err
	}
	return s, nil
}

// handshake accepts the control stream, reads the hello and registers the
// session with the edge.
func (s *session) handshake(ctx context.Context, deadline time.Time) error {
	ctrl, err := s.ys.AcceptStreamWithContext(ctx)
	if err != nil {
		return fmt.Errorf("accept control stream: %w", err)
	}
	s.ctrl = ctrl
	ctrl.SetReadDeadline(deadline)
	msg, err := mux.Read(ctrl)
	if err != nil {
		return fmt.Errorf("read hello: %w", err)
	}
	ctrl.SetReadDeadline(time.Time{})
	h, ok := msg.(*mux.Hello)
	if !ok {
		s.send(&mux.Error{Code: mux.CodeBadRequest, Message: "the first control message must be hello"})
		return fmt.Errorf("first message was %s, not hello", msg.MessageType())
	}
	if err := s.acceptHello(ctx, h); err != nil {
		return err
	}
	s.log.Info("agent connected")
	return nil
}

func (s *session) acceptHello(ctx context.Context, h *mux.Hello) error {
	e := s.e
	if h.Version != mux.Version {
		s.send(&mux.Error{Code: mux.CodeVersion, Message: fmt.Sprintf("this edge speaks protocol %d, the agent %d: upgrade the older one", mux.Version, h.Version)})
		return fmt.Errorf("protocol version %d", h.Version)
	}
	if !mux.ValidInstanceID(h.InstanceID) {
		s.send(&mux.Error{Code: mux.CodeBadRequest, Message: "instance_id must be 32 lower-case hex characters"})
		return errors.New("bad instance id")
	}
	policy := e.authenticate(h.Token)
	if policy == nil {
		if e.auth.fail(s.remote, time.Now()) {
			s.log.Warn("agent address refused for a while: too many hellos with a token the edge does not accept",
				"failures", e.cfg.AuthFailureLimit, "for", e.cfg.AuthFailureWindow)
		}
		// Counted before the agent hears of it, which may stop at once.
		e.metrics.bindResult(mux.CodeUnauthorized)
		s.send(&mux.Error{Code: mux.CodeUnauthorized, Message: "the edge does not accept this token: check --authtoken"})
		return errors.New("unauthorized token")
	}
	s.instanceID, s.tokenID, s.policy = mux.InstanceDigest(h.InstanceID), tokenID(h.Token), policy
	s.log = s.log.With("instance", s.instanceID) // before other goroutines can see s
	s.lastBeat.Store(time.Now().UnixNano())
	return s.register(ctx)
}

// register makes the session known, to the cluster registry and to the
// edge, and tells the agent. It is all or nothing: a session refused, or
// whose hello_ok could not be sent (the agent left, or gave up during a
// slow registry call), is forgotten everywhere before it returns, so that
// it never counts against a token's limit or holds a name.
func (s *session) register(ctx context.Context) error {
	e := s.e
	if err := e.openClusterSession(ctx, s); err != nil {
		// The write may have happened even though it failed: take it
		// back (retried until it succeeds).
		e.closeClusterSession(s.id)
		return err
	}
	if err := e.clusterSessionLimit(ctx, s); err != nil {
		return err
	}
	if err := e.addSession(s); err != nil {
		e.closeClusterSession(s.id)
		return err
	}
	s.hello.Store(true)
	err := s.send(&mux.HelloOK{SessionID: s.id, HeartbeatTimeoutMS: e.cfg.HeartbeatTimeout.Milliseconds(), MaxResponseHead: e.cfg.MaxResponseHead,
		Features: []string{mux.FeatureHostname, mux.FeatureVisitorCIDR, mux.FeatureTCP, mux.FeatureTLS, mux.FeatureWebhook, mux.FeatureOAuth, mux.FeaturePool}})
	if err != nil {
		e.unregister(s)
		return fmt.Errorf("send hello_ok: %w", err)
	}
	return nil
}

// unregister forgets a session that never got its hello_ok: it holds no
// binding yet.
func (e *Edge) unregister(s *session) {
	e.mu.Lock()
	delete(e.sessions, s.id)
	e.mu.Unlock()
	e.closeClusterSession(s.id)
}

// addSession adds s to the edge's sessions, unless the edge is closing
// or the token is at its session limit (in a cluster, clusterSessionLimit
// has counted every edge's sessions already). A reconnecting instance's own
// sessions do not count: it is about to take their bindings over.
func (e *Edge) addSession(s *session) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closing {
		s.send(&mux.Error{Code: mux.CodeShuttingDown, Message: "the edge is shutting down; retry"})
		return errors.New("edge shutting down")
	}
	if max := s.policy.MaxSessions; max > 0 && e.cluster == nil {
		n := 0
		for _, o := range e.sessions {
			if o.policy == s.policy && o.instanceID != s.instanceID {
				n++
			}
		}
		if n >= max {
			return e.refuseSessionLimit(s, max)
		}
	}
	e.sessions[s.id] = s
	return nil
}

// refuseSessionLimit tells the agent its token is at its session limit.
func (e *Edge) refuseSessionLimit(s *session, max int) error {
	e.metrics.bindResult(mux.CodeLimitExceeded)
	s.send(&mux.Error{Code: mux.CodeLimitExceeded, Message: fmt.Sprintf("this token is limited to %d concurrent agents; stop one first", max)})
	return errors.New("token session limit")
}

// acceptAgentStreams closes every stream the agent opens: the edge opens
// the streams of its exchanges. An agent that keeps opening them has its
// session closed.
func (s *session) acceptAgentStreams() {
	for refused := 0; ; {
		st, err := s.ys.AcceptStream()
		if err != nil {
			return
		}
		st.Close()
		if refused++; refused >= maxAgentStreams {
			s.log.Warn("agent keeps opening streams towards the edge; closing its session", "attempts", refused)
			s.close()
			return
		}
	}
}

// readControl handles control messages until the stream or session ends.
func (s *session) readControl(ctx context.Context) {
	for {
		msg, err := mux.Read(s.ctrl)
		if err != nil {
			if !errors.Is(err, io.EOF) && !s.isClosed() {
				s.log.Info("control stream ended", "err", err)
			}
			return
		}
		if err := s.handle(ctx, msg); err != nil {
			s.log.Info("closing session", "err", err)
			return
		}
	}
}

func (s *session) handle(ctx context.Context, msg mux.Message) error {
	switch m := msg.(type) {
	case *mux.Heartbeat:
		s.lastBeat.Store(time.Now().UnixNano())
		return s.send(&mux.HeartbeatAck{Seq: m.Seq})
	case *mux.Bind:
		s.bindMu.Lock()
		defer s.bindMu.Unlock()
		return s.send(s.e.metrics.bindReply(s.e.bind(ctx, s, m)))
	case *mux.Unbind:
		s.e.unbind(ctx, s, m.Hostname)
		return s.send(&mux.Unbound{Hostname: m.Hostname})
	case *mux.Health:
		s.health(m)
		return nil
	}
	return fmt.Errorf("unexpected %s message from agent", msg.MessageType())
}

// send writes one control message, bounded by controlWriteTimeout.
func (s *session) send(m mux.Message) error {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	if s.ctrl == nil {
		return errors.New("no control stream")
	}
	s.ctrl.SetWriteDeadline(time.Now().Add(controlWriteTimeout))
	err := mux.Write(s.ctrl, m)
	s.ctrl.SetWriteDeadline(time.Time{})
	return err
}

// live reports whether the session is open and heartbeated within the
// freshness window at now.
func (s *session) live(now time.Time) bool {
	if s.isClosed() || s.ys.IsClosed() {
		return false
	}
	return now.Sub(time.Unix(0, s.lastBeat.Load())) <= s.e.cfg.HeartbeatTimeout
}

func (s *session) isDraining() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.draining
}

func (s *session) helloDone() bool { return s.hello.Load() }

func (s *session) isClosed() bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

// holds reports whether the session still owns hostname at generation gen.
func (s *session) holds(hostname string, gen uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	g, ok := s.bindings[hostname]
	return ok && g == gen
}

// addBinding records that the session holds hostname at gen, as a pool
// member or not, unless gen was fenced already: a later bind took the name
// over between the registry's grant and this call.
func (s *session) addBinding(hostname string, gen uint64, access *visitorAccess, pool bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if gen <= s.fenced[hostname] {
		return false
	}
	s.bindings[hostname] = gen
	if s.access == nil {
		s.access = map[string]*visitorAccess{}
	}
	s.access[hostname] = access
	if pool {
		s.member(hostname) // its health counts
	} else {
		delete(s.members, hostname)
	}
	return true
}

// allows reports whether a visitor at ip may reach hostname through s.
func (s *session) allows(hostname string, ip netip.Addr) bool {
	s.mu.Lock()
	a := s.access[hostname]
	s.mu.Unlock()
	return a.allows(ip)
}

// The refused notices an agent gets, at most: its inspector lists them
// for a person to read, not to count (the edge's metrics count).
const (
	refusedPerSecond = 5
	refusedBurst     = 10
)

// tellRefused tells the agent of a request the edge answered itself, if
// the session's rate allows. The write is the control stream's, bounded
// by controlWriteTimeout: only an agent that stops reading it slows its
// own tunnel's refusals.
func (s *session) tellRefused(m *mux.Refused) {
	if !s.refusals.Allow() {
		return
	}
	if err := s.send(m); err != nil {
		s.log.Debug("refused notice not sent", "hostname", m.Hostname, "err", err)
	}
}

// checks are hostname's --verify-webhook check and OAuth rule; nil if none.
func (s *session) checks(hostname string) (*webhookCheck, *oauthRule) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.access[hostname]; a != nil {
		return a.webhook, a.oauth
	}
	return nil, nil
}

// fence takes hostname from the session up to generation gen: a binding at
// gen or older is removed, and one granted later at gen or older is never
// added. fresh is false when gen was fenced already (the registry's watch
// reports what the edge did itself too); left is how many bindings the
// session still holds.
func (s *session) fence(hostname string, gen uint64) (fresh bool, left int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if g, ok := s.bindings[hostname]; ok && g <= gen {
		delete(s.bindings, hostname)
		delete(s.access, hostname)
		delete(s.members, hostname)
	}
	fresh = gen > s.fenced[hostname]
	if fresh {
		if s.fenced == nil {
			s.fenced = map[string]uint64{}
		}
		s.fenced[hostname] = gen
	}
	return fresh, len(s.bindings)
}

func (s *session) snapshot() map[string]uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]uint64, len(s.bindings))
	for h, g := range s.bindings {
		out[h] = g
	}
	return out
}

// lingerClose ends a refused session: it half-closes the control stream,
// so the agent reads the refusal before the end of the stream, and closes the
// session once the agent has, or after a second. Closing at once could let
// the agent see "session shutdown" instead of the reason.
func (s *session) lingerClose() {
	if s.ctrl != nil {
		s.ctrl.Close()
		t := time.NewTimer(time.Second)
		select {
		case <-s.ys.CloseChan():
		case <-t.C:
		}
		t.Stop()
	}
	s.ys.Close()
}

// close closes the yamux session (and with it every stream) once.
func (s *session) close() {
	s.closeOnce.Do(func() {
		close(s.closed)
		s.ys.Close()
		if s.pool != nil {
			s.pool.CloseIdleConnections()
		}
	})
}

// drainThenClose lets accepted requests finish within DrainTimeout, then
// closes the session. Called when a session holds nothing any more.
func (s *session) drainThenClose() {
	s.mu.Lock()
	if s.draining {
		s.mu.Unlock()
		return
	}
	s.draining = true
	s.mu.Unlock()
	e := s.e
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), e.cfg.DrainTimeout)
		defer cancel()
		s.streams.Wait(ctx, s.closed)
		s.log.Info("session drained; closing", "inflight", s.streams.Count())
		s.lingerClose()
		s.close()
	}()
}

// endSession forgets the session. Bindings it still holds (it did not
// unbind: the connection broke or went stale) stay registered, offline, for
// one freshness window: visitors get 503 tunnel_offline with Retry-After
// rather than 404 while the agent reconnects, its own instance takes the name
// back at once (rule 1) and any other may take it (rule 2, holder dead).
// Then they are released, compare-and-delete.
func (e *Edge) endSession(s *session) {
	s.close()
	held := s.snapshot()
	e.metrics.sessionEnd(e.endCause(s))
	e.mu.Lock()
	delete(e.sessions, s.id)
	until := time.Now().Add(e.cfg.HeartbeatTimeout)
	for host, gen := range held {
		e.offline = append(e.offline, offlineBinding{host: host, session: s.id, gen: gen, until: until})
	}
	e.mu.Unlock()
	e.closeClusterSession(s.id)
	s.log.Info("agent disconnected", "offline_bindings", len(held))
}

// offlineBinding is a binding whose session ended without unbinding, or
// whose release failed: it is released after until.
type offlineBinding struct {
	host    string
	session uint64
	gen     uint64
	until   time.Time
	tries   int // failed releases so far
}

// releaseOffline releases the offline bindings whose grace has passed (all
// of them when now is zero). A release that fails (the registry did not
// answer) is tried again at the next tick, until it succeeds or finds the
// binding moved on: compare-and-delete makes a late release harmless.
func (e *Edge) releaseOffline(ctx context.Context, now time.Time) {
	e.mu.Lock()
	var due []offlineBinding
	keep := e.offline[:0]
	for _, o := range e.offline {
		if now.IsZero() || now.After(o.until) {
			due = append(due, o)
		} else {
			keep = append(keep, o)
		}
	}
	e.offline = keep
	e.mu.Unlock()
	for _, o := range due {
		e.release(ctx, o)
	}
}

// release releases one binding, compare-and-delete, or queues it to be
// tried again.
func (e *Edge) release(ctx context.Context, o offlineBinding) {
	ok, err := e.store.Release(ctx, o.host, o.session, o.gen)
	switch {
	case err != nil:
		o.tries++
		if o.tries == 1 || o.tries%100 == 0 {
			e.log.Warn("release failed; retrying", "hostname", o.host, "session", o.session, "generation", o.gen, "tries", o.tries, "err", err)
		}
		e.mu.Lock()
		if !e.closing {
			e.offline = append(e.offline, o)
		}
		e.mu.Unlock()
	case ok:
		e.log.Info("binding released", "hostname", o.host, "session", o.session, "generation", o.gen)
	}
}

// holderFor is what an agent of the token tokenID, which lost a name or
// was refused it, is told of b, the binding that holds it (nil: none, or
// not known): the holder's instance digest when it presented the same
// token, and its address too when that token is one (an edge open to all
// has no accounts to tell apart) and its session is on this edge; of a
// holder of another token, only that.
func (e *Edge) holderFor(b *registry.Binding, tokenID string) *mux.Holder {
	switch {
	case b == nil:
		return nil
	case b.Pool:
		return &mux.Holder{Pool: true, OtherToken: b.TokenID != tokenID}
	case b.TokenID != tokenID:
		return &mux.Holder{OtherToken: true}
	}
	h := &mux.Holder{Instance: b.InstanceID}
	if tokenID != "" && e.local(*b) {
		if s := e.session(b.SessionID); s != nil {
			h.Addr = s.remote
		}
	}
	return h
}

// evict fences prev's session for its hostname, tells it so (and, as
// holderFor lets it, who holds the name now: next, nil when the edge does
// not know), and drains it when it holds nothing else.
func (e *Edge) evict(prev registry.Binding, next *registry.Binding) {
	if !e.local(prev) {
		return
	}
	e.mu.Lock()
	old := e.sessions[prev.SessionID]
	if old == nil || e.closing {
		e.mu.Unlock()
		return
	}
	fresh, left := old.fence(prev.Hostname, prev.Generation)
	if !fresh {
		// Told already: the registry's watch reports the edge's own
		// takeovers and releases too.
		e.mu.Unlock()
		return
	}
	// Under e.mu, so that Close (which sets closing first) never waits
	// while this Add runs: evict is also called from the registry's watch.
	e.wg.Add(1)
	e.mu.Unlock()
	e.metrics.evicted()
	old.log.Info("binding taken over; session fenced", "hostname", prev.Hostname, "generation", prev.Generation)
	by := e.holderFor(next, prev.TokenID)
	// Its idle streams go at once; a busy one carries no exchange for
	// prev after this one (holds).
	old.pool.CloseIdleConnections()
	go func() {
		defer e.wg.Done()
		// Tell it before closing it, so the agent learns why.
		old.bindMu.Lock()
		old.send(&mux.Evicted{Hostname: prev.Hostname, Reason: mux.ReasonTakeover, By: by})
		old.bindMu.Unlock()
		if left == 0 {
			old.drainThenClose()
		}
	}()
}
