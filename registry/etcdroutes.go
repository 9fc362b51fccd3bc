package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The route cache. A watch on the prefix applies every change; it cannot
// tell by itself that it is current (a member that hangs, or lost its
// peers, keeps the stream open and says nothing). So every quarter of
// RouteStaleness the store reads the current revision (a linearizable
// read, which only a member in touch with the leader answers) and asks the
// watch for a progress notification: once the watch has delivered that
// revision, the cache is known to hold every change made before the read
// started (confirmedAt). Route trusts the cache only within RouteStaleness
// of that instant; past it, it reads the hostname from etcd. So an edge
// routes a hostname by a state at most RouteStaleness old: that is the
// longest two edges may route one name differently.

// maxVerified bounds the hostnames whose own reads are remembered while
// the cache is unconfirmed.
const maxVerified = 4096

// errWatchClosed means the watch channel closed without saying why.
var errWatchClosed = errors.New("registry: etcd watch closed")

// freshness is what the store knows of the cache's currency.
type freshness struct {
	confirmedAt time.Time            // the cache holds every change made before it
	verifiedAt  map[string]time.Time // the same, per hostname read by itself
	watchedRev  int64                // every event up to it has been applied
	watchSeen   time.Time            // the watch's last answer of any kind
	progressed  chan struct{}        // closed when watchedRev moves
	watcher     clientv3.Watcher     // the current watch's, for RequestProgress
	watchCtx    context.Context      // the same
	stopWatch   func(error)          // ends the current watch, with that cause
	stale       bool                 // logged as stale
}

// RouteStats says how fresh the route cache is and what Route did.
type RouteStats struct {
	// Age is the time since etcd last confirmed the cache current.
	Age time.Duration
	// Cached counts answers from the cache; Reread those read from etcd
	// because the cache was not confirmed within RouteStaleness; Failed
	// those etcd did not answer in time; Busy those refused because
	// maxRereads hostnames were being read already.
	Cached, Reread, Failed, Busy uint64
}

// Route returns hostname's binding for routing a visitor. It answers from
// the route cache while etcd has confirmed the cache (or this hostname)
// current within RouteStaleness, else it reads the hostname from etcd
// first. An error (ErrUnavailable) means neither could vouch for an
// answer: the caller must not route.
func (s *Etcd) Route(ctx context.Context, hostname string) (Binding, bool, error) {
	if b, ok, fresh := s.cached(hostname, time.Now()); fresh {
		s.counts.cached.Add(1)
		return b, ok, nil
	}
	if s.life == nil {
		return Binding{}, false, ErrUnavailable
	}
	ch := s.flight.DoChan(hostname, func() (any, error) {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, ErrUnavailable
		}
		s.wg.Add(1) // Close waits for the read
		s.mu.Unlock()
		defer s.wg.Done()
		return nil, s.reread(hostname)
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return Binding{}, false, r.Err
		}
		// A read this request joined may have started long before it.
		b, ok, fresh := s.cached(hostname, time.Now())
		if !fresh {
			s.counts.failed.Add(1)
			return Binding{}, false, fmt.Errorf("%w: etcd answered %s later than the route staleness", ErrUnavailable, hostname)
		}
		return b, ok, nil
	case <-ctx.Done():
		return Binding{}, false, ctx.Err()
	}
}

// reread reads hostname for Route, for every visitor waiting on it: the
// read is not bound to the first one's request.
func (s *Etcd) reread(hostname string) error {
	select {
	case s.rereads <- struct{}{}:
		defer func() { <-s.rereads }()
	default:
		s.counts.busy.Add(1)
		return fmt.Errorf("%w: %d hostnames being read from etcd already", ErrUnavailable, maxRereads)
	}
	// An answer later than the staleness after the read began is of no
	// use to Route: it is not fresh.
	ctx, cancel := context.WithTimeout(s.life, min(3*s.callTimeout, s.staleness))
	defer cancel()
	if _, _, err := s.read(ctx, hostname); err != nil {
		s.counts.failed.Add(1)
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	s.counts.reread.Add(1)
	return nil
}

// cached returns the cache's binding of host, and whether it is fresh.
func (s *Etcd) cached(host string, now time.Time) (Binding, bool, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.routes[host]
	at := s.fresh.confirmedAt
	if v := s.fresh.verifiedAt[host]; v.After(at) {
		at = v
	}
	return b, ok, now.Sub(at) <= s.staleness
}

// RouteStats returns the cache's age and Route's counts.
func (s *Etcd) RouteStats() RouteStats {
	s.mu.Lock()
	age := time.Since(s.fresh.confirmedAt)
	s.mu.Unlock()
	return RouteStats{Age: age, Cached: s.counts.cached.Load(), Reread: s.counts.reread.Load(),
		Failed: s.counts.failed.Load(), Busy: s.counts.busy.Load()}
}

// Lookup answers from the route cache, fresh or not: no I/O. For routing,
// use Route.
func (s *Etcd) Lookup(hostname string) (Binding, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.routes[hostname]
	return b, ok
}

// NodeAddr returns where node takes forwarded requests.
func (s *Etcd) NodeAddr(node string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.nodes[node]
	return a, ok
}

// read reads hostname from etcd (linearizable) and brings the cache up to
// it: the hostname's cache entry is then current as of the read's start.
func (s *Etcd) read(ctx context.Context, hostname string) (Binding, bool, error) {
	start := time.Now()
	st, err := s.readName(ctx, hostname)
	if err != nil {
		return Binding{}, false, fmt.Errorf("registry: get %s: %w", hostname, err)
	}
	s.mu.Lock()
	lost := s.applyStateLocked(hostname, st)
	s.mu.Unlock()
	s.takenOver(lost)
	s.verified(hostname, start)
	b, ok := st.binding()
	return b, ok, nil
}

func (s *Etcd) verified(host string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.fresh.verifiedAt
	if len(v) >= maxVerified {
		for h, t := range v {
			if time.Since(t) > s.staleness {
				delete(v, h)
			}
		}
	}
	if len(v) < maxVerified && at.After(v[host]) {
		v[host] = at
	}
}

// applyLocal applies a state of host this store read or wrote itself,
// reporting a binding of this node it ends.
func (s *Etcd) applyLocal(host string, b *Binding, rev int64) {
	s.mu.Lock()
	lost := s.applyLocked(host, b, rev)
	s.mu.Unlock()
	s.takenOver(lost)
}

// applyLocked records host's single binding at revision rev (b nil:
// deleted), unless the cache already knows a later state. It returns the
// bindings of this node the change ended. A pool's members are keys of
// their own: a binding's absence leaves them, and a binding written after
// them ends them (it is written only with their deletion).
func (s *Etcd) applyLocked(host string, b *Binding, rev int64) []Binding {
	cur, had := s.routes[host]
	var lost []Binding
	if had && cur.Pool {
		if b == nil || rev <= s.poolRevLocked(host) {
			return nil
		}
		lost, had = s.dropPoolLocked(host, rev), false
	}
	if had && uint64(rev) <= cur.Generation {
		return nil
	}
	if t, ok := s.tombs[host]; ok && rev <= t.rev {
		return lost
	}
	if b != nil {
		s.routes[host] = *b
	} else {
		delete(s.routes, host)
		s.tombs[host] = tomb{rev: rev, at: time.Now()}
	}
	if had && cur.Node == s.cfg.Node && (b == nil || b.Node != cur.Node || b.SessionID != cur.SessionID) {
		lost = append(lost, cur)
	}
	return lost
}

// takenOver reports bindings of this node that are no longer its own. Our
// own releases and takeovers show up here too; the edge ignores a binding
// its session no longer holds.
func (s *Etcd) takenOver(prev []Binding) {
	if s.hooks.TakenOver == nil {
		return
	}
	for _, b := range prev {
		s.hooks.TakenOver(b)
	}
}

// load reads hosts, pools and nodes into the caches, confirmed current as
// of the read's start, and sets the revision the watch resumes after.
// Bindings of this node that vanished since the last load (while the
// watch was down) are reported taken over.
func (s *Etcd) load(ctx context.Context) error {
	start := time.Now()
	resp, err := s.get(ctx, s.cfg.Prefix, clientv3.WithPrefix())
	if err != nil {
		return err
	}
	routes, pools, nodes := map[string]Binding{}, map[string]map[string]memberAt{}, map[string]string{}
	for _, kv := range resp.Kvs {
		s.collect(kv, routes, pools, nodes)
	}
	s.mu.Lock()
	old := s.routes
	s.routes, s.pools, s.nodes, s.tombs = routes, pools, nodes, map[string]tomb{}
	for h := range pools {
		s.sealLocked(h)
	}
	var gone []Binding
	for h, b := range old {
		for _, o := range b.Owners() {
			if o.Node != s.cfg.Node {
				continue
			}
			if nb, ok := s.routes[h].Member(o.Generation); !ok || nb.SessionID != o.SessionID {
				gone = append(gone, o)
			}
		}
	}
	s.progressLocked(resp.Header.Revision)
	s.confirmLocked(start)
	s.mu.Unlock()
	s.takenOver(gone)
	return nil
}

func (s *Etcd) collect(kv *mvccpb.KeyValue, routes map[string]Binding, pools map[string]map[string]memberAt, nodes map[string]string) {
	k := strings.TrimPrefix(string(kv.Key), s.cfg.Prefix)
	switch {
	case strings.HasPrefix(k, "hosts/"):
		h := strings.TrimPrefix(k, "hosts/")
		if b, err := s.decode(h, kv.Value, kv.ModRevision); err == nil {
			routes[h] = b
		}
	case strings.HasPrefix(k, "members/"):
		h, id, ok := splitMember(strings.TrimPrefix(k, "members/"))
		if !ok {
			return
		}
		if b, err := s.decodeMember(h, kv); err == nil {
			if pools[h] == nil {
				pools[h] = map[string]memberAt{}
			}
			pools[h][id] = memberAt{b: b, mod: kv.ModRevision}
		}
	case strings.HasPrefix(k, "nodes/"):
		var n nodeRecord
		if json.Unmarshal(kv.Value, &n) == nil {
			nodes[strings.TrimPrefix(k, "nodes/")] = n.Addr
		}
	}
}

// watch applies every change under the prefix to the caches. A watch that
// breaks, or that confirmLoop finds silent, is replaced by one resuming
// after the last revision applied; one that fell behind etcd's compaction
// reloads the caches.
func (s *Etcd) watch(ctx context.Context) {
	defer s.wg.Done()
	for ctx.Err() == nil {
		err := s.watchFrom(ctx, s.watched())
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, rpctypes.ErrCompacted):
			s.log.Warn("cluster watch fell behind etcd's compaction; reloading routes", "err", err)
			s.reload(ctx)
		default:
			s.log.Info("cluster watch restarted", "after_revision", s.watched(), "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(s.callTimeout / 8):
			}
		}
	}
}

func (s *Etcd) reload(ctx context.Context) {
	for ctx.Err() == nil {
		err := s.load(ctx)
		if err == nil {
			return
		}
		s.log.Warn("cluster routes not reloaded yet", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(s.cfg.RetryInterval):
		}
	}
}

// watchFrom runs one watch from revision rev+1, on the next member in
// turn, until it breaks or confirmLoop ends it. Through the balancer, a new
// watch landed on the hung member its last one was silent on, round after
// round, and the cache went unconfirmed for a call timeout each time.
func (s *Etcd) watchFrom(ctx context.Context, rev int64) error {
	s.watchTurn++
	conn, err := s.members.conn(s, s.watchTurn)
	if err != nil {
		return err
	}
	w := clientv3.NewWatchFromWatchClient(pb.NewWatchClient(conn), s.cli)
	defer w.Close()
	wctx, stop := context.WithCancelCause(clientv3.WithRequireLeader(ctx))
	defer stop(nil)
	s.mu.Lock()
	s.fresh.watcher, s.fresh.watchCtx, s.fresh.stopWatch = w, wctx, stop
	s.mu.Unlock()
	// Watch returns once the member has created the watch: a silent one
	// holds it until wctx ends.
	wch := w.Watch(wctx, s.cfg.Prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithProgressNotify())
	for {
		select {
		case <-wctx.Done():
			return context.Cause(wctx)
		case wr, ok := <-wch:
			switch {
			case wctx.Err() != nil:
				return context.Cause(wctx)
			case !ok:
				return errWatchClosed
			case wr.Err() != nil:
				return wr.Err()
			}
			s.watchResponse(wr)
		}
	}
}

// watchStop returns what ends the current watch; before the first, nothing.
func (s *Etcd) watchStop() func(error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fresh.stopWatch == nil {
		return func(error) {}
	}
	return s.fresh.stopWatch
}

func (s *Etcd) watchResponse(wr clientv3.WatchResponse) {
	var top int64
	for _, ev := range wr.Events {
		s.event(ev)
		top = max(top, ev.Kv.ModRevision)
	}
	if wr.IsProgressNotify() {
		top = wr.Header.Revision
	}
	s.mu.Lock()
	s.progressLocked(top)
	s.mu.Unlock()
	s.pruneTombs()
}

// watched returns the revision up to which every event has been applied.
func (s *Etcd) watched() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fresh.watchedRev
}

func (s *Etcd) progressLocked(rev int64) {
	f := &s.fresh
	f.watchSeen = time.Now()
	if rev > f.watchedRev {
		f.watchedRev = rev
		close(f.progressed)
		f.progressed = make(chan struct{})
	}
}

func (s *Etcd) event(ev *clientv3.Event) {
	k := strings.TrimPrefix(string(ev.Kv.Key), s.cfg.Prefix)
	switch {
	case strings.HasPrefix(k, "hosts/"):
		h := strings.TrimPrefix(k, "hosts/")
		var now *Binding
		if ev.Type == mvccpb.PUT {
			// A value that does not decode holds no route.
			if b, err := s.decode(h, ev.Kv.Value, ev.Kv.ModRevision); err == nil {
				now = &b
			}
		}
		s.applyLocal(h, now, ev.Kv.ModRevision)
	case strings.HasPrefix(k, "members/"):
		h, id, ok := splitMember(strings.TrimPrefix(k, "members/"))
		if !ok {
			return
		}
		var now *Binding
		if ev.Type == mvccpb.PUT {
			if b, err := s.decodeMember(h, ev.Kv); err == nil {
				now = &b
			}
		}
		s.mu.Lock()
		lost := s.applyMemberLocked(h, id, now, ev.Kv.ModRevision)
		s.mu.Unlock()
		s.takenOver(lost)
	case strings.HasPrefix(k, "nodes/"):
		n := strings.TrimPrefix(k, "nodes/")
		s.mu.Lock()
		if ev.Type == mvccpb.DELETE {
			delete(s.nodes, n)
		} else {
			var r nodeRecord
			if json.Unmarshal(ev.Kv.Value, &r) == nil {
				s.nodes[n] = r.Addr
			}
		}
		s.mu.Unlock()
	}
}

// pruneTombs drops tombstones older than any write still in flight could be.
func (s *Etcd) pruneTombs() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if time.Since(s.pruned) < 10*time.Second {
		return
	}
	s.pruned = time.Now()
	for h, t := range s.tombs {
		if time.Since(t.at) > time.Minute {
			delete(s.tombs, h)
		}
	}
}

// confirmLoop confirms the cache current every quarter of RouteStaleness
// or so: jittered, as the client's balancer takes members in turn, and a
// loop in step with another would send the calls of one to the same member
// every time (a hung one, as the fault test found).
// A watch that answers nothing when asked for its progress, or that stays
// behind for two rounds in a row (its member may have lost its peers, and
// still answers from what it has), is ended, and the watch loop replaces
// it; the round ends the watch it asked, not one opened since.
func (s *Etcd) confirmLoop(ctx context.Context) {
	defer s.wg.Done()
	behind := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(jitter(s.staleness / 4)):
		}
		stop := s.watchStop()
		silent, err := s.confirm(ctx)
		switch {
		case err == nil:
			behind = 0
			continue
		case errors.Is(err, errBehind):
			behind++
		}
		if silent || behind >= 2 {
			behind = 0
			stop(errStalled)
		}
		s.noteStale(err)
	}
}

// errBehind means the watch had not delivered the current revision.
var errBehind = errors.New("registry: the watch is behind etcd")

// confirm reads the current revision and waits for the watch to deliver
// it; the cache is then current as of the read's start. The watch is asked
// for its progress at once too, so that a watch that says nothing at all
// (silent) is found a call timeout into the round, however long the read
// took.
func (s *Etcd) confirm(ctx context.Context) (silent bool, err error) {
	start := time.Now()
	s.requestProgress()
	rctx, cancel := context.WithTimeout(ctx, s.staleness/2)
	defer cancel()
	resp, err := s.get(rctx, s.nodeKey(s.cfg.Node), clientv3.WithCountOnly())
	if err != nil {
		return s.silentSince(start), err
	}
	if silent, err := s.awaitWatched(ctx, resp.Header.Revision, start); err != nil {
		return silent, err
	}
	s.mu.Lock()
	s.confirmLocked(start)
	wasStale := s.fresh.stale
	s.fresh.stale = false
	s.mu.Unlock()
	if wasStale {
		s.log.Info("cluster route cache confirmed current again")
	}
	return false, nil
}

// awaitWatched waits for the watch to deliver rev, asking it for a
// progress notification again, until a call timeout after asked (the
// round's first request) and at least half of one from now.
func (s *Etcd) awaitWatched(ctx context.Context, rev int64, asked time.Time) (silent bool, err error) {
	deadline := time.NewTimer(max(time.Until(asked.Add(s.callTimeout)), s.callTimeout/2))
	defer deadline.Stop()
	for requested := false; ; requested = true {
		s.mu.Lock()
		got, wake := s.fresh.watchedRev, s.fresh.progressed
		s.mu.Unlock()
		if got >= rev {
			return false, nil
		}
		if !requested {
			s.requestProgress()
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return false, ctx.Err()
		case <-deadline.C:
			silent = s.silentSince(asked)
			return silent, fmt.Errorf("%w: revision %d not delivered (at %d, silent %v)", errBehind, rev, got, silent)
		}
	}
}

// requestProgress asks the current watch for a progress notification.
func (s *Etcd) requestProgress() {
	s.mu.Lock()
	w, wctx := s.fresh.watcher, s.fresh.watchCtx
	s.mu.Unlock()
	if w == nil {
		return
	}
	pctx, cancel := context.WithTimeout(wctx, s.callTimeout)
	defer cancel()
	w.RequestProgress(pctx)
}

// silentSince reports a watch that has said nothing since asked, though
// asked then for its progress, for a call timeout.
func (s *Etcd) silentSince(asked time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Since(asked) >= s.callTimeout && s.fresh.watchSeen.Before(asked)
}

func (s *Etcd) confirmLocked(at time.Time) {
	f := &s.fresh
	if at.After(f.confirmedAt) {
		f.confirmedAt = at
	}
	for h, t := range f.verifiedAt {
		if !t.After(at) {
			delete(f.verifiedAt, h)
		}
	}
}

// noteStale logs, once, that the cache has gone unconfirmed for longer
// than RouteStaleness.
func (s *Etcd) noteStale(err error) {
	s.mu.Lock()
	age := time.Since(s.fresh.confirmedAt)
	first := age > s.staleness && !s.fresh.stale
	if first {
		s.fresh.stale = true
	}
	s.mu.Unlock()
	if first {
		s.log.Warn("cluster route cache not confirmed current by etcd: each route is read from etcd until it is; check the etcd members' health",
			"age", age.Round(time.Millisecond), "route_staleness", s.staleness, "err", err)
	}
}
