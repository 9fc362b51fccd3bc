package registry

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ErrUnavailable is returned by a cluster store that cannot vouch for its
// answers now: it lost its lease, or etcd did not answer. Callers retry.
var ErrUnavailable = errors.New("registry: cluster registry unavailable")

// DefaultEtcdPrefix is where the cluster keeps its keys.
const DefaultEtcdPrefix = "/ngstone/v1/"

// bindAttempts bounds the optimistic retries of one Bind under contention.
const bindAttempts = 64

// EtcdConfig configures an Etcd store.
type EtcdConfig struct {
	// Endpoints are the etcd members' client URLs (http:// or https://).
	Endpoints []string
	// TLS is the client TLS for https endpoints; nil means the system's
	// roots and no client certificate.
	TLS *tls.Config
	// Username and Password authenticate to an etcd with auth enabled;
	// empty means none.
	Username, Password string
	// Prefix of every key; empty means DefaultEtcdPrefix.
	Prefix string
	// Node is this edge's name, unique in the cluster.
	Node string
	// LeaseTTL is the life of the node lease without renewal: an edge cut
	// off from etcd loses its bindings after it. Zero means 10s; it is
	// rounded up to whole seconds.
	LeaseTTL time.Duration
	// RetryInterval paces attempts to regain a lost lease; zero means 1s.
	RetryInterval time.Duration
	// Log receives lease and watch events; nil discards them.
	Log *slog.Logger
}

// Hooks tell the edge what the cluster did. Each may be nil. They are
// called from the store's watch and lease loops, one at a time: a slow hook
// delays those loops, so hooks hand long work to goroutines of their own.
type Hooks struct {
	// TakenOver reports a binding of this node that another edge replaced
	// or deleted: its session must be fenced and told.
	TakenOver func(prev Binding)
	// Lost reports that the node lease was lost: the store refuses binds
	// until Regained, and every session of this node must close.
	Lost func(err error)
	// Regained reports a new lease after Lost.
	Regained func()
}

// Etcd is the cluster Store: several edges share one etcd.
//
// Keys, under Prefix:
//
//	hosts/HOSTNAME         the binding (JSON); its ModRevision is the generation
//	sessions/NODE/SESSION  present while that session is live; {"token_id",
//	                       "instance_id"} it presented
//	nodes/NODE             {"addr": ...}: where other edges forward to
//
// All three are attached to the writing node's lease, so an edge that dies
// or is cut off from etcd leaves nothing behind after LeaseTTL. A holder is
// live while its session key exists: the edge deletes it when the session
// ends (so rule 2 applies at once, as on one edge) and the lease removes it
// when the edge is gone. Each rule is one transaction guarded by the
// binding's ModRevision, and rule 2 also by the absence of the holder's
// session key; Release deletes only while the ModRevision is the caller's
// generation.
//
// A watch on the prefix keeps a route cache (Lookup, NodeAddr) and reports
// bindings of this node taken over elsewhere (Hooks.TakenOver).
type Etcd struct {
	cfg   EtcdConfig
	cli   *etcdClient
	log   *slog.Logger
	addr  string
	hooks Hooks

	mu     sync.Mutex
	lease  int64
	ready  bool
	routes map[string]Binding
	tombs  map[string]tomb // hostnames deleted, so a late event cannot revive them
	pruned time.Time
	nodes  map[string]string

	stop context.CancelFunc
	wg   sync.WaitGroup
}

type tomb struct {
	rev int64
	at  time.Time
}

// record is a binding as stored in etcd; the hostname is the key and the
// generation the key's ModRevision.
type record struct {
	InstanceID string    `json:"instance_id"`
	TokenID    string    `json:"token_id"`
	SessionID  uint64    `json:"session_id"`
	Node       string    `json:"node"`
	BoundAt    time.Time `json:"bound_at"`
}

type nodeRecord struct {
	Addr string `json:"addr"`
}

// NewEtcd returns a store that has not started; it does no I/O.
func NewEtcd(cfg EtcdConfig) *Etcd {
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultEtcdPrefix
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = 10 * time.Second
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = time.Second
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Etcd{
		cfg: cfg, cli: newEtcdClient(cfg.Endpoints, cfg.TLS, cfg.Username, cfg.Password), log: log.With("node", cfg.Node),
		routes: map[string]Binding{}, tombs: map[string]tomb{}, nodes: map[string]string{},
	}
}

// Node returns this edge's name.
func (s *Etcd) Node() string { return s.cfg.Node }

// Start registers the node with addr, where other edges forward visitor
// requests to it, loads the route cache and keeps both current until Close.
// If the node name is still registered by an earlier process (one that
// crashed), Start waits for its lease to expire, until ctx ends.
func (s *Etcd) Start(ctx context.Context, addr string, hooks Hooks) error {
	s.addr, s.hooks = addr, hooks
	if err := s.register(ctx, true); err != nil {
		return err
	}
	rev, err := s.load(ctx)
	if err != nil {
		s.revoke()
		return fmt.Errorf("cluster: load routes: %w", err)
	}
	lctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.stop = stop
	s.wg.Add(2)
	go s.keepAlive(lctx)
	go s.watch(lctx, rev)
	return nil
}

// Close stops the loops and revokes the node lease: this edge's sessions,
// bindings and node key disappear from the cluster at once.
func (s *Etcd) Close() error {
	if s.stop != nil {
		s.stop()
	}
	s.wg.Wait()
	s.revoke()
	s.cli.close()
	return nil
}

// Ready reports whether the store holds a lease and accepts binds.
func (s *Etcd) Ready() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ready
}

func (s *Etcd) hostKey(h string) string { return s.cfg.Prefix + "hosts/" + h }
func (s *Etcd) nodeKey(n string) string { return s.cfg.Prefix + "nodes/" + n }
func (s *Etcd) sessionKey(node string, id uint64) string {
	return s.cfg.Prefix + "sessions/" + node + "/" + strconv.FormatUint(id, 10)
}

func (s *Etcd) currentLease() (int64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lease, s.ready
}

// register grants a lease and creates the node key on it. The key must be
// absent: two live edges with one name would share session keys. With wait,
// a key left by a dead process is waited out.
func (s *Etcd) register(ctx context.Context, wait bool) error {
	ttl := int64(math.Ceil(s.cfg.LeaseTTL.Seconds()))
	val, _ := json.Marshal(nodeRecord{Addr: s.addr})
	key := s.nodeKey(s.cfg.Node)
	for warned := false; ; {
		lease, err := s.cli.grant(ctx, ttl)
		if err != nil && warned && ctx.Err() != nil {
			return s.nameInUse(err)
		}
		if err != nil {
			return fmt.Errorf("cluster: grant lease: %w", err)
		}
		tr, err := s.cli.txn(ctx, etcdTxnReq{
			Compare: []etcdCmp{absent(key)},
			Success: []etcdOp{{Put: &etcdPutReq{Key: []byte(key), Value: val, Lease: lease}}},
		})
		if err == nil && tr.Succeeded {
			s.mu.Lock()
			s.lease, s.ready = lease, true
			s.mu.Unlock()
			s.log.Info("cluster node registered", "lease_ttl", time.Duration(ttl)*time.Second, "addr", s.addr)
			return nil
		}
		s.cli.revoke(context.WithoutCancel(ctx), lease)
		if err != nil && warned && ctx.Err() != nil {
			return s.nameInUse(err)
		}
		if err != nil {
			return fmt.Errorf("cluster: register node: %w", err)
		}
		if !wait {
			return fmt.Errorf("cluster: node name %q is registered by another edge", s.cfg.Node)
		}
		if !warned {
			s.log.Warn("node name still registered, by another edge or an earlier process: waiting for its lease to expire", "lease_ttl", time.Duration(ttl)*time.Second)
			warned = true
		}
		select {
		case <-ctx.Done():
			return s.nameInUse(ctx.Err())
		case <-time.After(s.cfg.RetryInterval):
		}
	}
}

func (s *Etcd) nameInUse(err error) error {
	return fmt.Errorf("cluster: node name %q is registered by a live edge: choose another --node-name: %w", s.cfg.Node, err)
}

func (s *Etcd) revoke() {
	s.mu.Lock()
	lease, ready := s.lease, s.ready
	s.ready = false
	s.mu.Unlock()
	if !ready {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.cli.revoke(ctx, lease); err != nil {
		s.log.Warn("cluster lease revoke failed; it expires by itself", "err", err)
	}
}

// keepAlive renews the node lease every third of its TTL. Without a
// renewal for two thirds of it, the lease is declared lost before etcd
// expires it: the edge stops vouching for its sessions while their
// bindings still stand, so no other edge can be granted them while this
// one still routes to them. Then it registers again, every RetryInterval.
func (s *Etcd) keepAlive(ctx context.Context) {
	defer s.wg.Done()
	every := s.cfg.LeaseTTL / 3
	tick := time.NewTicker(min(every, s.cfg.RetryInterval))
	defer tick.Stop()
	lastOK := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		lease, ready := s.currentLease()
		if !ready {
			// The lost lease may still hold the node key (it was declared
			// lost before etcd expired it): end it, so that registering
			// again need not wait for the expiry.
			rctx, cancel := context.WithTimeout(ctx, every)
			s.cli.revoke(rctx, lease)
			cancel()
			if err := s.register(ctx, false); err == nil {
				lastOK = time.Now()
				s.log.Info("cluster lease regained")
				if s.hooks.Regained != nil {
					s.hooks.Regained()
				}
			}
			continue
		}
		if time.Since(lastOK) < every {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, every)
		err := s.cli.keepAliveOnce(rctx, lease)
		cancel()
		switch {
		case err == nil:
			lastOK = time.Now()
		case ctx.Err() != nil:
			return
		case errors.Is(err, errLeaseNotFound) || time.Since(lastOK) > 2*s.cfg.LeaseTTL/3:
			s.lost(err)
		}
	}
}

func (s *Etcd) lost(err error) {
	s.mu.Lock()
	s.ready = false
	s.mu.Unlock()
	s.log.Error("cluster lease lost: closing this edge's sessions until it is regained", "err", err)
	if s.hooks.Lost != nil {
		s.hooks.Lost(err)
	}
}

// Session is a live session as the cluster registry records it, with the
// token (a digest) and instance it presented, so that a token's session
// limit can hold across the edges.
type Session struct {
	Node       string `json:"-"`
	ID         uint64 `json:"-"`
	TokenID    string `json:"token_id,omitempty"`
	InstanceID string `json:"instance_id,omitempty"`
}

// OpenSession records a live session of this node (sess.Node is ignored).
func (s *Etcd) OpenSession(ctx context.Context, sess Session) error {
	lease, ready := s.currentLease()
	if !ready {
		return ErrUnavailable
	}
	val, err := json.Marshal(sess)
	if err != nil {
		return err
	}
	if err := s.cli.put(ctx, s.sessionKey(s.cfg.Node, sess.ID), string(val), lease); err != nil {
		return fmt.Errorf("cluster: open session %d: %w", sess.ID, err)
	}
	return nil
}

// Sessions returns the live sessions of every node. A session whose record
// does not decode (written by an older edge, which wrote none, or by
// anything else) is returned with its node and id only.
func (s *Etcd) Sessions(ctx context.Context) ([]Session, error) {
	prefix := s.cfg.Prefix + "sessions/"
	resp, err := s.cli.get(ctx, prefix, true)
	if err != nil {
		return nil, fmt.Errorf("registry: sessions: %w", err)
	}
	out := make([]Session, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if sess, ok := parseSession(strings.TrimPrefix(string(kv.Key), prefix), kv.Value); ok {
			out = append(out, sess)
		}
	}
	return out, nil
}

// parseSession reads a session record: key NODE/ID, value its JSON. ok is
// false when the key is not of that form.
func parseSession(key string, val []byte) (Session, bool) {
	i := strings.LastIndexByte(key, '/')
	if i <= 0 {
		return Session{}, false
	}
	id, err := strconv.ParseUint(key[i+1:], 10, 64)
	if err != nil {
		return Session{}, false
	}
	var sess Session
	if json.Unmarshal(val, &sess) != nil {
		sess = Session{}
	}
	sess.Node, sess.ID = key[:i], id
	return sess, true
}

// CloseSession marks a session of this node dead: rule 2 applies to its
// bindings from now on.
func (s *Etcd) CloseSession(ctx context.Context, id uint64) error {
	if err := s.cli.delete(ctx, s.sessionKey(s.cfg.Node, id)); err != nil {
		return fmt.Errorf("cluster: close session %d: %w", id, err)
	}
	return nil
}

// Bind applies the binding rules, each as one guarded transaction, and
// retries when another edge wrote the key in between.
func (s *Etcd) Bind(ctx context.Context, c Claim) (Result, error) {
	if c.Hostname == "" {
		return Result{}, fmt.Errorf("registry: bind: empty hostname")
	}
	key := s.hostKey(c.Hostname)
	for range bindAttempts {
		lease, ready := s.currentLease()
		if !ready {
			return Result{}, ErrUnavailable
		}
		resp, err := s.cli.get(ctx, key, false)
		if err != nil {
			return Result{}, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
		}
		var old Binding
		var oldRev int64
		held := len(resp.Kvs) > 0
		if held {
			kv := resp.Kvs[0]
			if old, err = s.decode(c.Hostname, kv.Value, kv.ModRevision); err != nil {
				return Result{}, err
			}
			oldRev = kv.ModRevision
		}
		res, done, err := s.tryBind(ctx, c, lease, key, old, held, oldRev)
		if done || err != nil {
			return res, err
		}
	}
	return Result{}, fmt.Errorf("registry: bind %s: %w: %d attempts lost to concurrent writers", c.Hostname, ErrUnavailable, bindAttempts)
}

// tryBind decides on the binding read at oldRev and commits the decision
// if the key is still as read. done is false when it was not.
func (s *Etcd) tryBind(ctx context.Context, c Claim, lease int64, key string, old Binding, held bool, oldRev int64) (Result, bool, error) {
	cmps := []etcdCmp{modIs(key, oldRev)}
	var outcome Outcome
	var reread []etcdOp // what a failed transaction reads back
	switch {
	case !held:
		outcome, cmps = Created, []etcdCmp{absent(key)}
	case c.Exclusive:
		return Result{}, true, ErrTaken
	case old.SessionID == c.SessionID && old.Node == c.Node && sameInstance(old, c):
		return Result{Binding: old, Outcome: Unchanged}, true, nil
	case sameInstance(old, c):
		outcome = SameInstance
	default:
		outcome = DeadHolder
		cmps = append(cmps, absent(s.sessionKey(old.Node, old.SessionID)))
		// Failing, it tells a live holder (rule 3) from a changed key.
		reread = []etcdOp{{Range: &etcdRangeReq{Key: []byte(key), KeysOnly: true}}}
	}
	b := Binding{Hostname: c.Hostname, InstanceID: c.InstanceID, TokenID: c.TokenID,
		SessionID: c.SessionID, Node: c.Node, BoundAt: time.Now().UTC().Round(0)}
	val, _ := json.Marshal(record{InstanceID: b.InstanceID, TokenID: b.TokenID, SessionID: b.SessionID, Node: b.Node, BoundAt: b.BoundAt})
	tr, err := s.cli.txn(ctx, etcdTxnReq{
		Compare: cmps,
		Success: []etcdOp{{Put: &etcdPutReq{Key: []byte(key), Value: val, Lease: lease}}},
		Failure: reread,
	})
	if err != nil {
		return Result{}, true, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
	}
	if !tr.Succeeded {
		if outcome == DeadHolder && keyAt(tr, oldRev) {
			// The binding is as read, so the holder's session key stood
			// in the way: it is live (rule 3).
			return Result{}, true, ErrTaken
		}
		return Result{}, false, nil
	}
	b.Generation = uint64(tr.Header.Revision)
	s.applyPut(b)
	res := Result{Binding: b, Outcome: outcome}
	if held {
		res.Previous = &old
	}
	return res, true, nil
}

// keyAt reports whether the Else branch of tr read the key at rev.
func keyAt(tr *etcdTxnResp, rev int64) bool {
	if len(tr.Responses) == 0 || tr.Responses[0].Range == nil {
		return false
	}
	kvs := tr.Responses[0].Range.Kvs
	return len(kvs) == 1 && kvs[0].ModRevision == rev
}

// Release deletes hostname while sessionID at generation owns it.
func (s *Etcd) Release(ctx context.Context, hostname string, sessionID, generation uint64) (bool, error) {
	if generation > math.MaxInt64 {
		return false, nil
	}
	key := s.hostKey(hostname)
	resp, err := s.cli.get(ctx, key, false)
	if err != nil {
		return false, fmt.Errorf("registry: release %s: %w", hostname, err)
	}
	if len(resp.Kvs) == 0 || resp.Kvs[0].ModRevision != int64(generation) {
		return false, nil
	}
	// A ModRevision names one write, so the owner read here is the owner
	// the guarded delete below removes.
	old, err := s.decode(hostname, resp.Kvs[0].Value, resp.Kvs[0].ModRevision)
	if err != nil || old.SessionID != sessionID {
		return false, err
	}
	tr, err := s.cli.txn(ctx, etcdTxnReq{
		Compare: []etcdCmp{modIs(key, int64(generation))},
		Success: []etcdOp{{Delete: &etcdDeleteReq{Key: []byte(key)}}},
	})
	if err != nil {
		return false, fmt.Errorf("registry: release %s: %w", hostname, err)
	}
	if tr.Succeeded {
		s.applyDelete(hostname, tr.Header.Revision)
	}
	return tr.Succeeded, nil
}

// Get reads hostname's binding from etcd (linearizable) and refreshes the
// route cache with it.
func (s *Etcd) Get(ctx context.Context, hostname string) (Binding, bool, error) {
	resp, err := s.cli.get(ctx, s.hostKey(hostname), false)
	if err != nil {
		return Binding{}, false, fmt.Errorf("registry: get %s: %w", hostname, err)
	}
	if len(resp.Kvs) == 0 {
		s.applyDelete(hostname, resp.Header.Revision)
		return Binding{}, false, nil
	}
	b, err := s.decode(hostname, resp.Kvs[0].Value, resp.Kvs[0].ModRevision)
	if err != nil {
		return Binding{}, false, err
	}
	s.applyPut(b)
	return b, true, nil
}

// List reads every binding from etcd, sorted by hostname.
func (s *Etcd) List(ctx context.Context) ([]Binding, error) {
	prefix := s.hostKey("")
	resp, err := s.cli.get(ctx, prefix, true)
	if err != nil {
		return nil, fmt.Errorf("registry: list: %w", err)
	}
	out := make([]Binding, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		b, err := s.decode(strings.TrimPrefix(string(kv.Key), prefix), kv.Value, kv.ModRevision)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}

// Lookup answers from the route cache: no I/O, possibly a moment old. A
// stale answer is caught by the owner, which refuses a generation it does
// not hold.
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

func (s *Etcd) decode(hostname string, val []byte, rev int64) (Binding, error) {
	var r record
	if err := json.Unmarshal(val, &r); err != nil {
		return Binding{}, fmt.Errorf("registry: binding of %s in etcd is not valid: %w", hostname, err)
	}
	return Binding{Hostname: hostname, InstanceID: r.InstanceID, TokenID: r.TokenID, SessionID: r.SessionID,
		Node: r.Node, Generation: uint64(rev), BoundAt: r.BoundAt}, nil
}

// applyPut records b unless the cache already knows a later write.
func (s *Etcd) applyPut(b Binding) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cur, ok := s.routes[b.Hostname]; ok && cur.Generation >= b.Generation {
		return
	}
	if t, ok := s.tombs[b.Hostname]; ok && uint64(t.rev) >= b.Generation {
		return
	}
	s.routes[b.Hostname] = b
}

// applyDelete forgets hostname as of revision rev.
func (s *Etcd) applyDelete(hostname string, rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cur, ok := s.routes[hostname]; ok && cur.Generation < uint64(rev) {
		delete(s.routes, hostname)
		s.tombs[hostname] = tomb{rev: rev, at: time.Now()}
	}
}

// load reads hosts and nodes into the caches and returns the revision to
// watch from. Bindings of this node that vanished since the last load
// (while the watch was down) are reported taken over.
func (s *Etcd) load(ctx context.Context) (int64, error) {
	resp, err := s.cli.get(ctx, s.cfg.Prefix, true)
	if err != nil {
		return 0, err
	}
	routes, nodes := map[string]Binding{}, map[string]string{}
	for _, kv := range resp.Kvs {
		s.collect(kv, routes, nodes)
	}
	s.mu.Lock()
	var gone []Binding
	for h, b := range s.routes {
		if b.Node != s.cfg.Node {
			continue
		}
		if nb, ok := routes[h]; !ok || nb.Node != b.Node || nb.SessionID != b.SessionID {
			gone = append(gone, b)
		}
	}
	s.routes, s.nodes, s.tombs = routes, nodes, map[string]tomb{}
	s.mu.Unlock()
	for _, b := range gone {
		s.takenOver(b)
	}
	return resp.Header.Revision, nil
}

func (s *Etcd) collect(kv etcdKV, routes map[string]Binding, nodes map[string]string) {
	k := strings.TrimPrefix(string(kv.Key), s.cfg.Prefix)
	switch {
	case strings.HasPrefix(k, "hosts/"):
		h := strings.TrimPrefix(k, "hosts/")
		if b, err := s.decode(h, kv.Value, kv.ModRevision); err == nil {
			routes[h] = b
		}
	case strings.HasPrefix(k, "nodes/"):
		var n nodeRecord
		if json.Unmarshal(kv.Value, &n) == nil {
			nodes[strings.TrimPrefix(k, "nodes/")] = n.Addr
		}
	}
}

// watch applies every change under the prefix to the caches, reloading
// when the watch breaks (compaction, a member gone).
func (s *Etcd) watch(ctx context.Context, rev int64) {
	defer s.wg.Done()
	for ctx.Err() == nil {
		err := s.cli.watch(ctx, s.cfg.Prefix, rev+1, func(resp *etcdWatchResp) {
			for _, ev := range resp.Result.Events {
				s.event(ev)
			}
			rev = max(rev, resp.Result.Header.Revision)
			s.pruneTombs()
		})
		if ctx.Err() != nil {
			return
		}
		s.log.Warn("cluster watch broken; reloading routes", "err", err)
		for ctx.Err() == nil {
			r, err := s.load(ctx)
			if err == nil {
				rev = r
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(s.cfg.RetryInterval):
			}
		}
	}
}

func (s *Etcd) event(ev etcdEvent) {
	k := strings.TrimPrefix(string(ev.Kv.Key), s.cfg.Prefix)
	switch {
	case strings.HasPrefix(k, "hosts/"):
		h := strings.TrimPrefix(k, "hosts/")
		var now *Binding
		if ev.Type != "DELETE" {
			if b, err := s.decode(h, ev.Kv.Value, ev.Kv.ModRevision); err == nil {
				s.applyPut(b)
				now = &b
			}
		} else {
			s.applyDelete(h, ev.Kv.ModRevision)
		}
		if ev.PrevKv != nil {
			if prev, err := s.decode(h, ev.PrevKv.Value, ev.PrevKv.ModRevision); err == nil && prev.Node == s.cfg.Node &&
				(now == nil || now.Node != prev.Node || now.SessionID != prev.SessionID) {
				s.takenOver(prev)
			}
		}
	case strings.HasPrefix(k, "nodes/"):
		n := strings.TrimPrefix(k, "nodes/")
		s.mu.Lock()
		if ev.Type == "DELETE" {
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

// takenOver reports a binding of this node that is no longer its own. Our
// own releases and takeovers show up here too; the edge ignores a binding
// its session no longer holds.
func (s *Etcd) takenOver(prev Binding) {
	if s.hooks.TakenOver != nil {
		s.hooks.TakenOver(prev)
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
