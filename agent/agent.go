// Package agent is ngstone's client: it dials the edge, binds its tunnels'
// hostnames and serves the edge's streams to their local services.
//
// Invariant: the agent acts only on its current session. On any session
// error it dials anew with decorrelated-jitter backoff and binds each name
// with takeover, so it gets them back as soon as it reaches the edge, while
// the abandoned session keeps answering the requests it had accepted until
// DrainTimeout. A bind refusal and an eviction by another instance are
// final for that name; the agent stops when no name is left.
package agent

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// Final errors returned by Run; anything else was retried.
var (
	// ErrEvicted: another instance took the hostname (every one, for an
	// agent of several tunnels) while this agent was unreachable. The
	// agent stops advertising its URLs.
	ErrEvicted = errors.New("agent: hostname taken over by another agent")
)

// evictedError is ErrEvicted with the reason the edge gave, and what it
// said of the agent that holds the name now.
type evictedError struct {
	reason string
	by     mux.Holder
}

func newEvictedError(reason string, by *mux.Holder) *evictedError {
	e := &evictedError{reason: reason}
	if by != nil {
		e.by = *by
	}
	return e
}

func (e *evictedError) Error() string {
	if by := e.by.String(); by != "" {
		return ErrEvicted.Error() + " (" + e.reason + "; by " + by + ")"
	}
	return ErrEvicted.Error() + " (" + e.reason + ")"
}
func (e *evictedError) Unwrap() error { return ErrEvicted }

// EvictedBy is what the edge said, in the eviction err reports, of the
// agent that holds the name now; nothing for any other error.
func EvictedBy(err error) mux.Holder {
	var ee *evictedError
	if errors.As(err, &ee) {
		return ee.by
	}
	return mux.Holder{}
}

// RefusedError is the edge's final refusal of a hello or bind.
type RefusedError struct {
	Code    string // a DESIGN.md code: subdomain_taken, invalid_name, reserved_name, unauthorized…
	Message string // a sentence a person can act on
}

func (e *RefusedError) Error() string { return e.Code + ": " + e.Message }

// retryError is an edge's answer that asks the agent to connect again,
// after at least after (an address refused for failed hellos).
type retryError struct {
	err   error
	after time.Duration
}

func (e *retryError) Error() string { return e.err.Error() }
func (e *retryError) Unwrap() error { return e.err }

// retryAfter is how long err asks the agent to wait before it connects
// again; zero if it does not say.
func retryAfter(err error) time.Duration {
	var re *retryError
	if errors.As(err, &re) {
		return re.after
	}
	return 0
}

// Agent is one `ngstone http` or `ngstone start` process: its tunnels on
// one session.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	tunnels []*tunnel
	inspect *Inspector // nil: no inspector
	stats   *stats

	mu     sync.Mutex
	status Status
	hosts  map[string]*tunnel // every hostname bound, to its tunnel

	wg sync.WaitGroup // abandoned sessions still draining

	current atomic.Pointer[conn] // the session serving, nil between two
}

// New checks cfg and returns an agent; it does no I/O.
func New(cfg Config, log *slog.Logger) (*Agent, error) {
	cfg = cfg.withDefaults()
	if cfg.InstanceID == "" {
		cfg.InstanceID = NewInstanceID()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	digest := mux.InstanceDigest(cfg.InstanceID)
	a := &Agent{cfg: cfg, log: log.With("instance", digest), hosts: map[string]*tunnel{}}
	for _, tc := range cfg.tunnels() {
		t, err := newTunnel(a, tc)
		if err != nil {
			return nil, err
		}
		a.tunnels = append(a.tunnels, t)
	}
	a.useResponseHeadLimit(mux.MaxResponseHead)
	if cfg.InspectAddr != "" {
		a.inspect = newInspector(a)
	}
	a.stats = newStats()
	a.status = Status{State: StateConnecting, InstanceID: digest, Edge: cfg.Edge, Since: time.Now()}
	a.summarizeLocked()
	return a, nil
}

// summarizeLocked sets the status's tunnels, and its single-tunnel fields
// from the first tunnel that holds its name (the first when none does).
func (a *Agent) summarizeLocked() {
	s := &a.status
	s.Tunnels = make([]TunnelStatus, len(a.tunnels))
	first := -1
	for i, t := range a.tunnels {
		s.Tunnels[i] = t.st
		s.Tunnels[i].URLs = slices.Clone(t.st.URLs)
		if first < 0 && !t.final() {
			first = i
		}
	}
	if first < 0 {
		first = 0
	}
	t := s.Tunnels[first]
	s.Local, s.Hostname, s.URL, s.URLs, s.Generation = t.Local, t.Hostname, t.URL, t.URLs, t.Generation
}

// NewInstanceID returns 16 random bytes as 32 hex characters.
func NewInstanceID() string {
	b := make([]byte, 16)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// InstanceID returns the agent's instance id, a secret: show its
// mux.InstanceDigest.
func (a *Agent) InstanceID() string { return a.cfg.InstanceID }

// Inspector returns the agent's inspector; nil without one.
func (a *Agent) Inspector() *Inspector { return a.inspect }

// Status returns the current status.
func (a *Agent) Status() Status {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.status
}

// Stats returns the agent's connection counters and its last requests.
func (a *Agent) Stats() Stats { return a.stats.snapshot(time.Now()) }

// setStatus changes the status with f and reports it; Since follows a
// change of State.
func (a *Agent) setStatus(f func(*Status)) {
	a.mu.Lock()
	prev := a.status.State
	f(&a.status)
	if a.status.State != prev {
		a.status.Since = time.Now()
	}
	a.summarizeLocked()
	st := a.status
	a.mu.Unlock()
	if a.cfg.OnStatus != nil {
		a.cfg.OnStatus(st)
	}
}

// setLatency records a round trip to the edge. It is not a change of
// state: nothing is reported.
func (a *Agent) setLatency(d time.Duration) {
	a.mu.Lock()
	a.status.Latency = d
	a.mu.Unlock()
}

// latency is the last round trip measured to the edge; zero before any.
func (a *Agent) latency() time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.status.Latency
}

// Run connects and serves until ctx ends (then it unbinds gracefully and
// returns nil) or a final error: a *RefusedError or ErrEvicted. Before it
// returns, every session it abandoned has drained.
func (a *Agent) Run(ctx context.Context) error {
	tc, err := a.tlsConfig()
	if err != nil {
		return err
	}
	for _, t := range a.tunnels {
		if err := t.loadUpstreamCA(); err != nil {
			return err
		}
	}
	defer func() {
		for _, t := range a.tunnels {
			t.transport().CloseIdleConnections()
		}
	}()
	defer a.wg.Wait()
	if a.inspect != nil {
		stop, err := a.startInspector(ctx)
		if err != nil {
			return err
		}
		defer stop() // before a.wg.Wait
	}
	hctx, stopHealth := context.WithCancel(ctx)
	defer stopHealth() // before a.wg.Wait
	for _, t := range a.tunnels {
		if t.cfg.Pool {
			a.wg.Add(1)
			go func() {
				defer a.wg.Done()
				t.watchHealth(hctx)
			}()
		}
	}
	bo := backoff{base: a.cfg.BackoffBase, cap: a.cfg.BackoffCap}
	for attempt := 0; ; attempt++ {
		healthy, err := a.runSession(ctx, tc, attempt > 0)
		if ctx.Err() != nil {
			a.setStatus(func(s *Status) { s.State, s.Err = StateStopped, nil })
			return nil
		}
		if final := a.finalState(err); final != "" {
			var ee *evictedError
			errors.As(err, &ee)
			a.setStatus(func(s *Status) {
				s.State, s.Err, s.Hint = final, err, ""
				if ee != nil {
					s.EvictedReason, s.EvictedBy = ee.reason, ee.by
				}
			})
			return err
		}
		if healthy {
			bo.reset()
			attempt = 0
		}
		if err := a.wait(ctx, retryDelay(&bo, err), attempt+1, err); err != nil {
			a.setStatus(func(s *Status) { s.State, s.Err = StateStopped, nil })
			return nil
		}
	}
}

func (a *Agent) finalState(err error) State {
	var re *RefusedError
	switch {
	case errors.Is(err, ErrEvicted):
		return StateEvicted
	case errors.As(err, &re):
		return StateFailed
	}
	return ""
}

// retryDelay is the backoff's next delay, or longer if the edge asked for
// a longer wait (retryAfter), except after a connect none of whose
// attempts got an answer: it has already spent its dial timeout starting
// fresh attempts at their bounded pace into a silent path, so the next
// connect starts at once and the agent keeps probing until the path is
// back (staggered).
func retryDelay(bo *backoff, err error) time.Duration {
	d := bo.next(time.Now())
	if errors.Is(err, errNoAnswer) {
		return 0
	}
	return max(d, retryAfter(err))
}

// startInspector listens on the inspector's address (or the next free
// port of its range) and serves it until the returned stop. With every
// port of a range taken, the agent runs without it; a single address
// taken is an error.
func (a *Agent) startInspector(ctx context.Context) (stop func(), err error) {
	ln, err := listenRange(a.cfg.InspectAddr, a.cfg.InspectPorts)
	if err != nil && a.cfg.InspectPorts > 0 && errors.Is(err, syscall.EADDRINUSE) {
		a.log.Warn("inspector off: every port of its range is in use; pass --inspect-addr HOST:PORT", "from", a.cfg.InspectAddr, "ports", a.cfg.InspectPorts+1)
		return func() {}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("inspect-addr: %w", err)
	}
	ictx, cancel := context.WithCancel(ctx)
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		a.inspect.serve(ictx, ln)
	}()
	u := "http://" + ln.Addr().String()
	a.setStatus(func(s *Status) { s.InspectURL = u })
	a.log.Info("inspector", "url", u)
	return cancel, nil
}

// listenRange listens on addr, or when its port is taken on the next free
// one of the more ports after it.
func listenRange(addr string, more int) (net.Listener, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	p, err := strconv.Atoi(port)
	if err != nil || p == 0 {
		more = 0
	}
	for i := 0; ; i++ {
		ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p+i)))
		if err == nil || i >= more || p+i >= 65535 || !errors.Is(err, syscall.EADDRINUSE) {
			return ln, err
		}
	}
}

// wait sleeps d before reconnect attempt n, reporting it in the status
// with what a person can do about its cause.
func (a *Agent) wait(ctx context.Context, d time.Duration, n int, cause error) error {
	next := time.Now().Add(d)
	hint := a.hint(cause)
	a.setStatus(func(s *Status) {
		s.State, s.Attempt, s.NextRetry, s.Err, s.Hint = StateReconnecting, n, next, cause, hint
	})
	a.log.Debug("reconnect attempt", "attempt", n, "in", d.Round(time.Millisecond), "cause", ErrText(cause), "hint", hint)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// ErrText is err's text, or "" for nil: a log attribute that reads the
// same in text and JSON logs when there is no error.
func ErrText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func (a *Agent) tlsConfig() (*tls.Config, error) {
	host, _, _ := net.SplitHostPort(a.cfg.Edge)
	if a.cfg.ServerName != "" {
		host = a.cfg.ServerName
	}
	tc := &tls.Config{
		ServerName:         host,
		NextProtos:         []string{mux.ALPN},
		MinVersion:         tls.VersionTLS12,
		InsecureSkipVerify: a.cfg.Insecure,
		RootCAs:            a.cfg.RootCAs,
	}
	if tc.RootCAs == nil && a.cfg.CAFile != "" {
		pool, err := readCAFile("ca-file", a.cfg.CAFile)
		if err != nil {
			return nil, err
		}
		tc.RootCAs = pool
	}
	return tc, nil
}

// label returns the subdomain part of hostname.
func label(hostname string) string {
	l, _, _ := strings.Cut(hostname, ".")
	return l
}
