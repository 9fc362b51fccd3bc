package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The calls to etcd, on etcd's own patterns: each call has a deadline
// (CallTimeout) and requires a leader; a call safe to repeat is repeated,
// on the next member (members); a transaction
// whose answer was lost is read back, never resent; the lease is renewed
// by the client's KeepAlive. A member that hangs holds the keep-alive
// stream until gRPC's keepalive drops its connection (keepAliveTime plus
// its timeout), which the lease TTL must outlast (see EtcdConfig.LeaseTTL).

const (
	// dialTimeout bounds the first authentication of a client.
	dialTimeout = 5 * time.Second
	// keepAliveTime is how often gRPC pings an idle connection: its floor.
	keepAliveTime = 10 * time.Second
	// maxRereads bounds the hostnames Route reads from etcd at once.
	maxRereads = 64
)

// errStalled means etcd did not answer within CallTimeout on a stream
// that is still open: the member behind it may hang.
var errStalled = errors.New("registry: no answer from etcd within the call timeout")

// dial makes the etcd client and the lessor that renews the node lease.
// The endpoints are shuffled, so that edges do not all start on one member.
func (s *Etcd) dial() (err error) {
	eps := slices.Clone(s.cfg.Endpoints)
	rand.Shuffle(len(eps), func(i, j int) { eps[i], eps[j] = eps[j], eps[i] })
	s.cli, err = clientv3.New(clientv3.Config{
		Endpoints:            eps,
		TLS:                  s.cfg.TLS,
		Username:             s.cfg.Username,
		Password:             s.cfg.Password,
		DialTimeout:          dialTimeout,
		DialKeepAliveTime:    keepAliveTime,
		DialKeepAliveTimeout: max(2*s.callTimeout, time.Second),
		PermitWithoutStream:  true,
		Context:              s.life,
		// The store logs what matters (lease, watch, staleness) itself;
		// the client's own lines are per retried call.
		Logger: zap.NewNop(),
	})
	if err == nil {
		// The lessor gives up on a lease unanswered for this long (renew's
		// own bound comes first).
		s.lessor = clientv3.NewLeaseFromLeaseClient(sendTimes{clientv3.RetryLeaseClient(s.cli), s}, s.cli, s.cfg.LeaseTTL)
	}
	return err
}

// once runs call with a deadline of CallTimeout, requiring a leader: a
// member that lost its leader refuses the call at once instead of holding it.
func (s *Etcd) once(ctx context.Context, call func(context.Context) error) error {
	if s.cli == nil {
		return ErrUnavailable
	}
	cctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(ctx), s.callTimeout)
	defer cancel()
	return call(cctx)
}

// retry runs call (once) again while it fails in a way another attempt may
// not, until ctx or the store operation's budget ends; attempt counts from
// 0. call must be safe to repeat: a read, or a write whose repetition
// changes nothing. With one attempt, 2 of 2 fault-test runs failed
// LeaderKilled and MemberApplyStalled (e0 396/405 visits 200).
func (s *Etcd) retry(ctx context.Context, call func(ctx context.Context, attempt int) error) error {
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	for attempt := 0; ; attempt++ {
		actx, cancelAttempt := ctx, context.CancelFunc(func() {})
		if attempt == 0 {
			actx, cancelAttempt = s.firstAttempt(ctx)
		}
		err := s.once(actx, func(ctx context.Context) error { return call(ctx, attempt) })
		cancelAttempt()
		if err == nil || !transient(err) {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		// Not at once: every member may be refusing (an election).
		select {
		case <-ctx.Done():
		case <-time.After(jitter(s.callTimeout / 8)):
		}
	}
}

// firstAttempt bounds a call's first attempt to half a call timeout, and
// half the time ctx has: a member that holds it leaves time for another.
func (s *Etcd) firstAttempt(ctx context.Context) (context.Context, context.CancelFunc) {
	d := s.callTimeout / 2
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, time.Until(dl)/2)
	}
	return context.WithTimeout(ctx, d)
}

// jitter returns d give or take a quarter: loops at fixed intervals fall
// in step with the balancer's turns and send every call to one member.
func jitter(d time.Duration) time.Duration {
	return max(d*3/4+rand.N(d/2+1), time.Millisecond)
}

// get reads key (linearizable), retried.
func (s *Etcd) get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	// One Op for every attempt: options are closures that may write what
	// they captured (WithSort does), so they are applied once.
	resp, err := s.idempotent(ctx, clientv3.OpGet(key, opts...))
	return resp.Get(), err
}

// idempotent runs op, a read or a write whose repetition changes nothing,
// retried, each attempt on the next member (members).
func (s *Etcd) idempotent(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	var resp clientv3.OpResponse
	first := s.members.next()
	err := s.retry(ctx, func(ctx context.Context, attempt int) error {
		kv, err := s.members.kv(s, first+attempt)
		if err == nil {
			resp, err = kv.Do(ctx, op)
		}
		return err
	})
	return resp, err
}

// members are key-value clients of one member each, on a connection of
// its own (the client's Dial: its credentials, token and keepalive) made on
// first use. A call's first attempt goes to a member at random, the next
// ones to the members after it, so that the attempt after one that ran out
// goes elsewhere. Through the balancer, whose turns every call takes, the
// attempts fell in step with the route cache's checks and went to a hung
// member time after time.
type members struct {
	mu     sync.Mutex
	kvs    []clientv3.KV
	conns  []*grpc.ClientConn
	closed bool
}

// next returns the member a call's first attempt goes to.
func (ms *members) next() int { return rand.IntN(1 << 20) }

// kv returns member m's client (m modulo their number).
func (ms *members) kv(s *Etcd, m int) (clientv3.KV, error) {
	conn, err := ms.conn(s, m)
	if err != nil {
		return nil, err
	}
	ms.mu.Lock()
	defer ms.mu.Unlock()
	m %= len(ms.kvs)
	if ms.kvs[m] == nil {
		ms.kvs[m] = clientv3.NewKVFromKVClient(pb.NewKVClient(conn), s.cli)
	}
	return ms.kvs[m], nil
}

// conn returns the connection to member m (modulo their number).
func (ms *members) conn(s *Etcd, m int) (*grpc.ClientConn, error) {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if ms.closed {
		return nil, ErrUnavailable
	}
	if ms.conns == nil {
		ms.kvs, ms.conns = make([]clientv3.KV, len(s.cfg.Endpoints)), make([]*grpc.ClientConn, len(s.cfg.Endpoints))
	}
	m %= len(ms.conns)
	if ms.conns[m] == nil {
		c, err := s.cli.Dial(s.cfg.Endpoints[m])
		if err != nil {
			return nil, fmt.Errorf("registry: connect to %s: %w", s.cfg.Endpoints[m], err)
		}
		ms.conns[m] = c
	}
	return ms.conns[m], nil
}

// close closes the members' connections, for Close.
func (ms *members) close() {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	ms.closed = true
	for _, c := range ms.conns {
		if c != nil {
			c.Close()
		}
	}
}

// txn sends op, a guarded transaction, once, to the next member. An
// answer that does not settle it (an error, or a compare that failed) is
// for the caller to read back.
func (s *Etcd) txn(ctx context.Context, op clientv3.Op) (*clientv3.TxnResponse, error) {
	var resp clientv3.OpResponse
	ctx, cancel := s.firstAttempt(ctx) // an unclear answer is read back: that is the next attempt
	defer cancel()
	err := s.once(ctx, func(ctx context.Context) error {
		kv, err := s.members.kv(s, s.members.next())
		if err == nil {
			resp, err = kv.Do(ctx, op)
		}
		return err
	})
	return resp.Txn(), err
}

// transient reports whether err may pass on another attempt: a deadline,
// a member that is unreachable, leaderless, overloaded or broken (a member
// whose raft has stopped answers "raft: stopped", code Unknown), a stale
// auth token. Errors
// that another member would repeat (a lease not found, a compacted
// revision, a refused password, a request too large) are not.
func transient(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errStalled) {
		return true
	}
	// The client renews its token on these; the call may have raced a
	// change of etcd's users or roles.
	if errors.Is(err, rpctypes.ErrAuthOldRevision) || errors.Is(err, rpctypes.ErrInvalidAuthToken) {
		return true
	}
	var code codes.Code
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		code = ee.Code()
	} else if st, ok := status.FromError(err); ok {
		code = st.Code()
	} else {
		return false // not an answer from gRPC or etcd
	}
	switch code {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted, codes.Unknown, codes.Internal:
		return true
	}
	return false
}

// register grants a lease and creates the node key on it. The key must be
// absent: two live edges with one name would share session keys. With wait,
// a key left by a dead process is waited out. It returns when the grant was
// sent: the lease lives at least LeaseTTL from then.
func (s *Etcd) register(ctx context.Context, wait bool) (time.Time, error) {
	ttl := int64(math.Ceil(s.cfg.LeaseTTL.Seconds()))
	val, _ := json.Marshal(nodeRecord{Addr: s.addr})
	key := s.nodeKey(s.cfg.Node)
	for warned := false; ; {
		sent := time.Now()
		var lease clientv3.LeaseID
		// A grant whose answer was lost leaves a lease with no key: it expires.
		err := s.retry(ctx, func(ctx context.Context, _ int) error {
			resp, err := s.cli.Grant(ctx, ttl)
			if err == nil {
				lease = resp.ID
			}
			return err
		})
		if err != nil && warned && ctx.Err() != nil {
			return sent, s.nameInUse(err)
		}
		if err != nil {
			return sent, fmt.Errorf("cluster: grant lease: %w", err)
		}
		won, err := s.claimNode(ctx, key, string(val), lease)
		if err == nil && won {
			s.mu.Lock()
			s.lease, s.ready = lease, true
			s.mu.Unlock()
			s.log.Info("cluster node registered", "lease_ttl", time.Duration(ttl)*time.Second, "addr", s.addr)
			return sent, nil
		}
		s.revokeLease(context.WithoutCancel(ctx), lease)
		if err != nil && warned && ctx.Err() != nil {
			return sent, s.nameInUse(err)
		}
		if err != nil {
			return sent, fmt.Errorf("cluster: register node: %w", err)
		}
		if !wait {
			return sent, fmt.Errorf("cluster: node name %q is registered by another edge", s.cfg.Node)
		}
		if !warned {
			s.log.Warn("node name still registered, by another edge or an earlier process: waiting for its lease to expire", "lease_ttl", time.Duration(ttl)*time.Second)
			warned = true
		}
		select {
		case <-ctx.Done():
			return sent, s.nameInUse(ctx.Err())
		case <-time.After(s.cfg.RetryInterval):
		}
	}
}

// claimNode creates key on lease if it is absent. A transaction whose
// answer does not settle it is read back: the key on this lease means it
// was applied.
func (s *Etcd) claimNode(ctx context.Context, key, val string, lease clientv3.LeaseID) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	op := clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", 0)},
		[]clientv3.Op{clientv3.OpPut(key, val, clientv3.WithLease(lease))}, nil)
	for {
		tr, err := s.txn(ctx, op)
		if err == nil && tr.Succeeded {
			return true, nil
		}
		if err != nil && (!transient(err) || ctx.Err() != nil) {
			return false, err
		}
		resp, err := s.get(ctx, key)
		if err != nil {
			return false, err
		}
		if len(resp.Kvs) > 0 {
			return resp.Kvs[0].Lease == int64(lease), nil
		}
	}
}

func (s *Etcd) nameInUse(err error) error {
	return fmt.Errorf("cluster: node name %q is registered by a live edge: choose another --node-name: %w", s.cfg.Node, err)
}

// revoke ends the node lease, if it is held, for Close.
func (s *Etcd) revoke() {
	s.mu.Lock()
	lease, ready := s.lease, s.ready
	s.ready = false
	s.mu.Unlock()
	if ready {
		s.revokeLease(context.Background(), lease)
	}
}

// revokeLease ends lease, trying for three call timeouts: a lease already
// gone is fine, and one etcd does not hear of expires by itself.
func (s *Etcd) revokeLease(ctx context.Context, lease clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(ctx, 3*s.callTimeout)
	defer cancel()
	err := s.retry(ctx, func(ctx context.Context, _ int) error {
		_, err := s.cli.Revoke(ctx, lease)
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return nil
		}
		return err
	})
	if err != nil {
		s.log.Warn("cluster lease revoke failed; it expires by itself", "err", err)
	}
}

// keepAlive keeps the node lease. The lease is declared lost when no
// renewal sent in the last two thirds of its TTL was answered, before etcd
// can have expired it: the edge stops vouching for its sessions while
// their bindings still stand, so no other edge can be granted them while
// this one still routes to them. Then it registers again, every
// RetryInterval. okSent is when the grant was sent.
func (s *Etcd) keepAlive(ctx context.Context, okSent time.Time) {
	defer s.wg.Done()
	for ctx.Err() == nil {
		lease, ready := s.currentLease()
		if !ready {
			okSent = s.regain(ctx, lease)
			continue
		}
		err := s.renew(ctx, lease, okSent)
		if ctx.Err() != nil {
			return
		}
		s.lost(err)
	}
}

var (
	// errNotRenewed means no renewal was answered for two thirds of the TTL.
	errNotRenewed = errors.New("registry: no lease renewal answered for two thirds of the lease TTL")
	// errKeepAliveEnded means etcd no longer has the lease, or the lessor
	// gave up on it.
	errKeepAliveEnded = errors.New("registry: the lease's keep-alive ended: the lease expired or was revoked")
)

// renew keeps lease alive with the lessor's KeepAlive until the lease is
// lost (errNotRenewed), gone (errKeepAliveEnded), or ctx ends.
// okSent is when the last answered renewal (or the grant) was sent.
func (s *Etcd) renew(ctx context.Context, lease clientv3.LeaseID, okSent time.Time) error {
	kctx, cancel := context.WithCancel(ctx)
	defer cancel()
	answers, err := s.lessor.KeepAlive(kctx, lease)
	if err != nil {
		return err
	}
	lostAfter := 2 * s.cfg.LeaseTTL / 3
	timer := time.NewTimer(time.Until(okSent.Add(lostAfter)))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case _, ok := <-answers:
			if !ok {
				return errKeepAliveEnded
			}
			if sent := s.renewedSent(lease); sent.After(okSent) {
				okSent = sent
				timer.Reset(time.Until(okSent.Add(lostAfter)))
			}
		case <-timer.C:
			return fmt.Errorf("%w: the last answered renewal was sent %v ago", errNotRenewed, time.Since(okSent).Round(time.Millisecond))
		}
	}
}

// sendTimes is the lessor's lease client: it notes when each keep-alive
// request went out, so that an answer tells when the lease was renewed
// (its life runs from the request, not from the answer).
type sendTimes struct {
	pb.LeaseClient
	s *Etcd
}

func (l sendTimes) LeaseKeepAlive(ctx context.Context, opts ...grpc.CallOption) (pb.Lease_LeaseKeepAliveClient, error) {
	st, err := l.LeaseClient.LeaseKeepAlive(ctx, opts...)
	if err != nil {
		return nil, err
	}
	return &timedStream{Lease_LeaseKeepAliveClient: st, s: l.s}, nil
}

// timedStream is a keep-alive stream and the send times of its unanswered
// requests: etcd answers each, in order.
type timedStream struct {
	pb.Lease_LeaseKeepAliveClient
	s    *Etcd
	mu   sync.Mutex
	sent []time.Time
}

func (t *timedStream) Send(r *pb.LeaseKeepAliveRequest) error {
	t.mu.Lock()
	t.sent = append(t.sent, time.Now())
	t.mu.Unlock()
	return t.Lease_LeaseKeepAliveClient.Send(r)
}

func (t *timedStream) Recv() (*pb.LeaseKeepAliveResponse, error) {
	r, err := t.Lease_LeaseKeepAliveClient.Recv()
	if err != nil {
		return r, err
	}
	t.mu.Lock()
	var sent time.Time
	if len(t.sent) > 0 {
		sent, t.sent = t.sent[0], t.sent[1:]
	}
	t.mu.Unlock()
	if r.TTL > 0 && !sent.IsZero() {
		t.s.mu.Lock()
		if id := clientv3.LeaseID(r.ID); t.s.renewed.id != id || sent.After(t.s.renewed.sent) {
			t.s.renewed.id, t.s.renewed.sent = id, sent
		}
		t.s.mu.Unlock()
	}
	return r, nil
}

// renewedSent returns when the last answered renewal of lease was sent.
func (s *Etcd) renewedSent(lease clientv3.LeaseID) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.renewed.id != lease {
		return time.Time{}
	}
	return s.renewed.sent
}

func (s *Etcd) lost(err error) {
	s.mu.Lock()
	s.ready = false
	clear(s.open) // their records go with the lease
	s.mu.Unlock()
	s.log.Error("cluster lease lost: closing this edge's sessions until it is regained", "err", err)
	if s.hooks.Lost != nil {
		s.hooks.Lost(err)
	}
}

// regain registers the node again, every RetryInterval, until it succeeds
// or ctx ends. The lost lease may still hold the node key (it was declared
// lost before etcd expired it): it is revoked first, so that registering
// need not wait for the expiry.
func (s *Etcd) regain(ctx context.Context, old clientv3.LeaseID) time.Time {
	for ctx.Err() == nil {
		s.revokeLease(ctx, old)
		sent, err := s.register(ctx, false)
		if err == nil {
			s.log.Info("cluster lease regained")
			if s.hooks.Regained != nil {
				s.hooks.Regained()
			}
			return sent
		}
		s.log.Debug("cluster lease not regained yet", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(s.cfg.RetryInterval):
		}
	}
	return time.Now()
}

// reconcileLoop runs reconcile once per LeaseTTL while the lease is held.
func (s *Etcd) reconcileLoop(ctx context.Context) {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.LeaseTTL)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.Ready() {
			s.reconcile(ctx)
		}
	}
}

// reconcile deletes the session records of this node that no open session
// owns: a put that etcd applied after its caller had given up on it, and
// after the session had closed, would otherwise keep a dead holder live
// for as long as the node lease lasts.
func (s *Etcd) reconcile(ctx context.Context) {
	prefix := s.sessionPrefix(s.cfg.Node)
	resp, err := s.get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return
	}
	for _, kv := range resp.Kvs {
		id, err := strconv.ParseUint(strings.TrimPrefix(string(kv.Key), prefix), 10, 64)
		s.mu.Lock()
		_, open := s.open[id]
		s.mu.Unlock()
		if err == nil && open {
			continue
		}
		key := string(kv.Key)
		// Guarded: a session opened since the read keeps its record.
		err = s.once(ctx, func(ctx context.Context) error {
			_, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", kv.ModRevision)).Then(clientv3.OpDelete(key)).Commit()
			return err
		})
		s.log.Warn("cluster: removed a session record no open session of this edge owns", "key", key, "err", err)
	}
}
