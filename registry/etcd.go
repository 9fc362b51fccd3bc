package registry

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sync/singleflight"
)

// ErrUnavailable is returned by a cluster store that cannot vouch for its
// answers now: it lost its lease, or etcd did not answer. Callers retry.
var ErrUnavailable = errors.New("registry: cluster registry unavailable")

// DefaultEtcdPrefix is where the cluster keeps its keys.
const DefaultEtcdPrefix = "/ngstone/v1/"

// DefaultLeaseTTL is the node lease's TTL: concurrency.Session's. A hung
// member holds the lease's keep-alive stream until gRPC's keepalive drops
// it (10s and its timeout), which two thirds of it outlast with room.
const DefaultLeaseTTL = 60 * time.Second

// DefaultRouteStaleness is the route cache's default bound.
const DefaultRouteStaleness = 2 * time.Second

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
	// off from etcd loses its bindings after it. Zero means DefaultLeaseTTL;
	// it is rounded up to whole seconds.
	LeaseTTL time.Duration
	// CallTimeout bounds one call to etcd. A call that runs out is made
	// again (the client sends it to another member) when repeating it
	// changes nothing: reads, session records. A transaction that runs out
	// is never sent again blindly: its outcome is read back first. Zero
	// means a tenth of LeaseTTL, at most 1s.
	CallTimeout time.Duration
	// RouteStaleness is the longest the route cache is trusted after etcd
	// last confirmed it current; past it, Route reads each hostname from
	// etcd (linearizable) before answering. It bounds how long two edges
	// may route one hostname differently. Zero means DefaultRouteStaleness,
	// or a fifth of LeaseTTL when that is less.
	RouteStaleness time.Duration
	// RetryInterval paces attempts to regain a lost lease; zero means 1s.
	RetryInterval time.Duration
	// Log receives lease and watch events; nil discards them.
	Log *slog.Logger
}

// Hooks tell the edge what the cluster did. Each may be nil. They are
// called from the store's loops, one at a time: a slow hook delays those
// loops, so hooks hand long work to goroutines of their own.
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

// Etcd is the cluster Store: several edges share one etcd, through etcd's
// own Go client (its balancer spreads calls over the members and moves off
// one that fails; it refreshes auth tokens; its lessor renews the lease).
//
// Keys, under Prefix:
//
//	hosts/HOSTNAME         the binding (JSON); its ModRevision is the generation
//	members/HOSTNAME/NODE/SESSION
//	                       a pool's member, in place of hosts/HOSTNAME (etcdpool.go)
//	sessions/NODE/SESSION  present while that session is live; {"token_id",
//	                       "instance_id"} it presented
//	nodes/NODE             {"addr": ...}: where other edges forward to
//	reserved/KEY           the reservation of a key bound with Claim.Reserve:
//	                       {"token_id", "label", "for" (ns), "until"}, until
//	                       absent while the key is held (see Reservation)
//
// The first four are attached to the writing node's lease, so an edge that
// dies or is cut off from etcd leaves nothing behind after LeaseTTL; a
// reservation has no lease, as it must outlive its edge. A holder is
// live while its session key exists: the edge deletes it when the session
// ends (so rule 2 applies at once, as on one edge) and the lease removes it
// when the edge is gone. Each rule is one transaction guarded by the
// binding's ModRevision, and rule 2 also by the absence of the holder's
// session key, and a claim with Reserve also by its reservation's
// ModRevision; Release deletes only while the ModRevision is the caller's
// generation.
//
// A watch on the prefix keeps a route cache (Route, Lookup, NodeAddr),
// which reservations stay out of, and reports bindings of this node taken
// over elsewhere (Hooks.TakenOver). The cache is trusted only while etcd
// has confirmed it current within RouteStaleness (see Route).
type Etcd struct {
	cfg         EtcdConfig
	log         *slog.Logger
	addr        string
	hooks       Hooks
	cli         *clientv3.Client
	lessor      clientv3.Lease // renews the node lease, noting when (sendTimes)
	members     members        // where key-value calls and the watch go
	watchTurn   int            // the member of the current watch; the watch loop's
	callTimeout time.Duration
	opBudget    time.Duration // all attempts of one store operation: ten calls, at least the lease TTL
	staleness   time.Duration

	mu      sync.Mutex
	closed  bool
	lease   clientv3.LeaseID
	ready   bool
	renewed struct {
		id   clientv3.LeaseID
		sent time.Time // when its last answered renewal was sent
	}
	open   map[uint64]struct{}            // sessions of this node opened and not closed
	routes map[string]Binding             // single bindings, and pools sealed from pools
	pools  map[string]map[string]memberAt // hostname → member id → member
	tombs  map[string]tomb                // hostnames and members deleted, so a late event cannot revive them
	now    func() time.Time               // the reservations' clock
	pruned time.Time
	nodes  map[string]string
	fresh  freshness

	flight  singleflight.Group // one read per hostname at a time
	rereads chan struct{}      // bounds the hostnames read at once
	counts  routeCounts

	life      context.Context // ends at Close
	stop      context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
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
	Proto      string    `json:"proto,omitempty"` // absent in records from before TLS passthrough: HTTP
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
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = time.Second
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = min(cfg.LeaseTTL/10, time.Second)
	}
	if cfg.RouteStaleness <= 0 {
		cfg.RouteStaleness = min(cfg.LeaseTTL/5, DefaultRouteStaleness)
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Etcd{
		cfg: cfg, log: log.With("node", cfg.Node),
		callTimeout: cfg.CallTimeout, opBudget: max(cfg.LeaseTTL, 10*cfg.CallTimeout), staleness: cfg.RouteStaleness,
		open: map[uint64]struct{}{}, routes: map[string]Binding{}, pools: map[string]map[string]memberAt{}, tombs: map[string]tomb{}, nodes: map[string]string{}, now: time.Now,
		fresh:   freshness{verifiedAt: map[string]time.Time{}, progressed: make(chan struct{})},
		rereads: make(chan struct{}, maxRereads), watchTurn: rand.IntN(1 << 20),
	}
}

// Node returns this edge's name.
func (s *Etcd) Node() string { return s.cfg.Node }

// Start connects to etcd, registers the node with addr, where other edges
// forward visitor requests to it, loads the route cache and keeps all of
// it current until Close. If the node name is still registered by an
// earlier process (one that crashed), Start waits for its lease to expire,
// until ctx ends.
func (s *Etcd) Start(ctx context.Context, addr string, hooks Hooks) (err error) {
	s.addr, s.hooks = addr, hooks
	s.life, s.stop = context.WithCancel(context.WithoutCancel(ctx))
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if err = s.dial(); err != nil {
		return fmt.Errorf("cluster: connect to etcd: %w", err)
	}
	sent, err := s.register(ctx, true)
	if err != nil {
		return err
	}
	if err := s.load(ctx); err != nil {
		return fmt.Errorf("cluster: load routes: %w", err)
	}
	s.wg.Add(4)
	go s.keepAlive(s.life, sent)
	go s.watch(s.life)
	go s.confirmLoop(s.life)
	go s.reconcileLoop(s.life)
	return nil
}

// Close stops the loops and revokes the node lease: this edge's sessions,
// bindings and node key disappear from the cluster at once. Start calls it
// when it fails.
func (s *Etcd) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true // no goroutine starts after this
		s.mu.Unlock()
		if s.stop != nil {
			s.stop()
		}
		s.wg.Wait()
		s.members.close()
		s.revoke()
		if s.cli != nil {
			s.lessor.Close()
			s.cli.Close()
		}
	})
	return nil
}

// Ready reports whether the store holds a lease and accepts binds.
func (s *Etcd) Ready() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ready
}

func (s *Etcd) hostKey(h string) string    { return s.cfg.Prefix + "hosts/" + h }
func (s *Etcd) nodeKey(n string) string    { return s.cfg.Prefix + "nodes/" + n }
func (s *Etcd) reserveKey(k string) string { return s.cfg.Prefix + "reserved/" + k }
func (s *Etcd) sessionPrefix(node string) string {
	return s.cfg.Prefix + "sessions/" + node + "/"
}
func (s *Etcd) sessionKey(node string, id uint64) string {
	return s.sessionPrefix(node) + strconv.FormatUint(id, 10)
}

func (s *Etcd) currentLease() (clientv3.LeaseID, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lease, s.ready
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
	s.setOpen(sess.ID, true)
	_, err = s.idempotent(ctx, clientv3.OpPut(s.sessionKey(s.cfg.Node, sess.ID), string(val), clientv3.WithLease(lease)))
	if err != nil {
		// A put that etcd applies late is removed by reconcile.
		s.setOpen(sess.ID, false)
		return fmt.Errorf("cluster: open session %d: %w", sess.ID, err)
	}
	return nil
}

// CloseSession marks a session of this node dead: rule 2 applies to its
// bindings from now on.
func (s *Etcd) CloseSession(ctx context.Context, id uint64) error {
	s.setOpen(id, false)
	key := s.sessionKey(s.cfg.Node, id)
	if _, err := s.idempotent(ctx, clientv3.OpDelete(key)); err != nil {
		return fmt.Errorf("cluster: close session %d: %w", id, err)
	}
	return nil
}

func (s *Etcd) setOpen(id uint64, open bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if open {
		s.open[id] = struct{}{}
	} else {
		delete(s.open, id)
	}
}

// Sessions returns the live sessions of every node. A session whose record
// does not decode (written by an older edge, which wrote none, or by
// anything else) is returned with its node and id only.
func (s *Etcd) Sessions(ctx context.Context) ([]Session, error) {
	prefix := s.cfg.Prefix + "sessions/"
	resp, err := s.get(ctx, prefix, clientv3.WithPrefix())
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

// Bind applies the key's reservation (a claim with Reserve) and then the
// binding rules, each as one guarded transaction, and retries when another
// edge wrote the key or its reservation in between.
func (s *Etcd) Bind(ctx context.Context, c Claim) (Result, error) {
	if c.Hostname == "" {
		return Result{}, fmt.Errorf("registry: bind: empty hostname")
	}
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	key := s.hostKey(c.Hostname)
	for range bindAttempts {
		lease, ready := s.currentLease()
		if !ready {
			return Result{}, ErrUnavailable
		}
		st, err := s.readName(ctx, c.Hostname)
		if err != nil {
			return Result{}, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
		}
		// Read again each attempt, as the binding is: the transaction
		// commits only while both are as read.
		var rr reserveRead
		if c.Reserve > 0 {
			if rr, err = s.readReservation(ctx, c.Hostname); err != nil {
				return Result{}, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
			}
			if err := rr.kept().admit(c, s.clock()); err != nil {
				return Result{}, err
			}
		}
		var res Result
		var done bool
		if c.Pool || len(st.members) > 0 {
			res, done, err = s.tryPool(ctx, c, lease, st, rr)
		} else {
			res, done, err = s.tryBind(ctx, c, lease, key, st.single, rr)
		}
		if done || err != nil {
			return res, err
		}
	}
	return Result{}, fmt.Errorf("registry: bind %s: %w: %d attempts lost to concurrent writers", c.Hostname, ErrUnavailable, bindAttempts)
}

// held is a hostname's binding as read, at revision rev.
type held struct {
	b   Binding
	ok  bool
	rev int64
}

// tryBind decides on the binding read and commits the decision if the key
// (and for a claim with Reserve, its reservation rr) is still as read.
// done is false when it was not. No pool may hold the name meanwhile.
func (s *Etcd) tryBind(ctx context.Context, c Claim, lease clientv3.LeaseID, key string, cur held, rr reserveRead) (res Result, done bool, err error) {
	noPool := clientv3.Compare(clientv3.CreateRevision(s.memberPrefix(c.Hostname)), "=", 0).WithPrefix()
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", cur.rev), noPool}
	var outcome Outcome
	var reread []clientv3.Op // what a failed transaction reads back
	r, reserve := rr.kept().bound(c)
	switch old := cur.b; {
	case !cur.ok:
		outcome = Created
		cmps = []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", 0), noPool}
	case c.Exclusive:
		return Result{}, true, ErrTaken
	case old.SessionID == c.SessionID && old.Node == c.Node && sameInstance(old, c):
		if !reserve {
			return Result{Binding: old, Outcome: Unchanged}, true, nil
		}
		outcome = Unchanged // the reservation alone is written
	case sameInstance(old, c):
		outcome = SameInstance
	default:
		outcome = DeadHolder
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(s.sessionKey(old.Node, old.SessionID)), "=", 0))
		// Failing, it tells a live holder (rule 3) from a changed key.
		reread = []clientv3.Op{clientv3.OpGet(key, clientv3.WithKeysOnly())}
	}
	var ops []clientv3.Op
	if c.Reserve > 0 {
		// The reservation as read too: a key bound and released since the
		// read is absent again, as read, but reserved for its last token.
		rkey := s.reserveKey(c.Hostname)
		cmps = append(cmps, rr.unchanged(rkey))
		if reserve {
			ops = append(ops, clientv3.OpPut(rkey, string(encodeReservation(r))))
		}
		if reread != nil {
			reread = append(reread, clientv3.OpGet(rkey, clientv3.WithKeysOnly()))
		}
	}
	if outcome == Unchanged {
		return s.keepReservation(ctx, c, cur.b, cmps, ops)
	}
	b := Binding{Hostname: c.Hostname, InstanceID: c.InstanceID, TokenID: c.TokenID,
		SessionID: c.SessionID, Node: c.Node, BoundAt: time.Now().UTC().Round(0), Proto: c.Proto}
	val, _ := json.Marshal(record{InstanceID: b.InstanceID, TokenID: b.TokenID, SessionID: b.SessionID, Node: b.Node, BoundAt: b.BoundAt, Proto: b.Proto})
	ops = append(ops, clientv3.OpPut(key, string(val), clientv3.WithLease(lease)))
	tr, err := s.txn(ctx, clientv3.OpTxn(cmps, ops, reread))
	if err != nil && !transient(err) {
		return Result{}, true, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
	}
	if err != nil || !tr.Succeeded {
		// Applied or not: read, never resend.
		resp, rerr := s.get(ctx, key)
		switch {
		case rerr != nil:
			return Result{}, true, fmt.Errorf("registry: bind %s: read back: %w", c.Hostname, rerr)
		case holds(resp, val):
			tr = &clientv3.TxnResponse{Succeeded: true, Header: &pb.ResponseHeader{Revision: resp.Kvs[0].ModRevision}}
		case err == nil && outcome == DeadHolder && keyAt(tr, 0, cur.rev) && (c.Reserve <= 0 || keyAt(tr, 1, rr.rev)):
			// The binding (and reservation) was as read, so the holder's
			// session key stood in the way: it is live (rule 3). A pool
			// is never written beside a binding, so the key would have
			// changed had one come.
			return Result{}, true, ErrTaken
		default:
			return Result{}, false, nil
		}
	}
	b.Generation = uint64(tr.Header.Revision)
	s.applyLocal(c.Hostname, &b, tr.Header.Revision)
	res = Result{Binding: b, Outcome: outcome}
	if cur.ok {
		res.Previous = &cur.b
	}
	return res, true, nil
}

// keepReservation writes the reservation of an unchanged binding, old,
// that the claim changes (its label, or its clock stopped), guarded by
// cmps. A write that failed or whose answer was lost is for the next
// attempt to read: applied, it finds nothing left to write.
func (s *Etcd) keepReservation(ctx context.Context, c Claim, old Binding, cmps []clientv3.Cmp, ops []clientv3.Op) (Result, bool, error) {
	tr, err := s.txn(ctx, clientv3.OpTxn(cmps, ops, nil))
	switch {
	case err != nil && !transient(err):
		return Result{}, true, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
	case err == nil && tr.Succeeded:
		return Result{Binding: old, Outcome: Unchanged}, true, nil
	}
	return Result{}, false, nil
}

// holds reports whether the key read holds exactly val: a binding record
// names its session and the instant of its bind, so it is the write that
// made it.
func holds(resp *clientv3.GetResponse, val []byte) bool {
	return len(resp.Kvs) == 1 && string(resp.Kvs[0].Value) == string(val)
}

// keyAt reports whether the i-th read of the Else branch of tr found its
// key at rev (rev zero: absent).
func keyAt(tr *clientv3.TxnResponse, i int, rev int64) bool {
	if len(tr.Responses) <= i || tr.Responses[i].GetResponseRange() == nil {
		return false
	}
	kvs := tr.Responses[i].GetResponseRange().Kvs
	if rev == 0 {
		return len(kvs) == 0
	}
	return len(kvs) == 1 && kvs[0].ModRevision == rev
}

// Release deletes hostname while sessionID at generation owns it. The
// delete is sent once per attempt: a compare that failed is then this
// call's own answer (another Release of the same binding won, or a bind
// replaced it), so two callers never both report the deletion. Only after
// a delete whose answer was lost does a hostname found gone count as
// released by this call. The delete reads the key's reservation too, to
// start its clock (startReservation).
func (s *Etcd) Release(ctx context.Context, hostname string, sessionID, generation uint64) (bool, error) {
	if generation > math.MaxInt64 {
		return false, nil
	}
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	key, gen := s.hostKey(hostname), int64(generation)
	for sent := false; ; {
		resp, err := s.get(ctx, key)
		if err != nil {
			return false, fmt.Errorf("registry: release %s: %w", hostname, err)
		}
		if len(resp.Kvs) == 0 || resp.Kvs[0].ModRevision != gen {
			if !sent {
				return s.releaseMember(ctx, hostname, sessionID, gen)
			}
			return len(resp.Kvs) == 0, nil
		}
		// A ModRevision names one write, so the owner read here is the
		// owner the guarded delete below removes.
		old, err := s.decode(hostname, resp.Kvs[0].Value, gen)
		if err != nil || old.SessionID != sessionID {
			return false, err
		}
		tr, err := s.txn(ctx, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", gen)},
			[]clientv3.Op{clientv3.OpDelete(key), clientv3.OpGet(s.reserveKey(hostname))}, nil))
		switch {
		case err != nil && !transient(err):
			return false, fmt.Errorf("registry: release %s: %w", hostname, err)
		case err == nil && tr.Succeeded:
			s.applyLocal(hostname, nil, tr.Header.Revision)
			s.startReservation(ctx, hostname, tr.Responses[1].GetResponseRange().GetKvs())
			return true, nil
		case err != nil:
			// Applied or not: read, and resend only while it stands.
			sent = true
		}
		if ctx.Err() != nil {
			return false, fmt.Errorf("registry: release %s: %w", hostname, ctx.Err())
		}
	}
}

// Get reads hostname's binding from etcd (linearizable) and refreshes the
// route cache with it.
func (s *Etcd) Get(ctx context.Context, hostname string) (Binding, bool, error) {
	return s.read(ctx, hostname)
}

// List reads every binding and pool from etcd, at one revision, sorted by
// hostname.
func (s *Etcd) List(ctx context.Context) ([]Binding, error) {
	hosts, members := s.hostKey(""), s.cfg.Prefix+"members/"
	resp, err := s.idempotent(ctx, clientv3.OpTxn(nil, []clientv3.Op{
		clientv3.OpGet(hosts, clientv3.WithPrefix()), clientv3.OpGet(members, clientv3.WithPrefix())}, nil))
	if err != nil {
		return nil, fmt.Errorf("registry: list: %w", err)
	}
	tr := resp.Txn()
	var out []Binding
	for _, kv := range tr.Responses[0].GetResponseRange().GetKvs() {
		b, err := s.decode(strings.TrimPrefix(string(kv.Key), hosts), kv.Value, kv.ModRevision)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	pools := map[string][]Binding{}
	for _, kv := range tr.Responses[1].GetResponseRange().GetKvs() {
		h, _, ok := splitMember(strings.TrimPrefix(string(kv.Key), members))
		if !ok {
			continue
		}
		b, err := s.decodeMember(h, kv)
		if err != nil {
			return nil, err
		}
		pools[h] = append(pools[h], b)
	}
	for h, ms := range pools {
		out = append(out, poolOf(h, ms))
	}
	slices.SortFunc(out, func(a, b Binding) int { return strings.Compare(a.Hostname, b.Hostname) })
	return out, nil
}

func (s *Etcd) decode(hostname string, val []byte, rev int64) (Binding, error) {
	var r record
	if err := json.Unmarshal(val, &r); err != nil {
		return Binding{}, fmt.Errorf("registry: binding of %s in etcd is not valid: %w", hostname, err)
	}
	return Binding{Hostname: hostname, InstanceID: r.InstanceID, TokenID: r.TokenID, SessionID: r.SessionID,
		Node: r.Node, Generation: uint64(rev), BoundAt: r.BoundAt, Proto: r.Proto}, nil
}

// routeCounts counts Route's answers, for RouteStats.
type routeCounts struct {
	cached, reread, failed, busy atomic.Uint64
}
