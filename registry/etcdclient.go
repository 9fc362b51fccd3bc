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

// The calls to etcd. etcd's client balances calls over the members, moves
// off one whose connection fails and refreshes the auth token; what it
// does not do is notice a member that keeps its connection open and stops
// answering before gRPC's keepalive does (10 s at the soonest, plus its
// timeout), nor put a deadline on a call. So every call here has one
// (CallTimeout), reads are hedged (hedged), calls that are safe to repeat
// are repeated (retry), a transaction whose answer was lost is read back,
// not resent, and the lease is renewed on one more stream, on another
// member, as soon as no stream has answered within CallTimeout (renew).
// etcd's own KeepAlive, and concurrency.Session on it, renew on one
// stream, which a hung member stalls until gRPC's keepalive gives up on
// the connection: longer than two thirds of the default TTL.

const (
	// dialTimeout bounds the first authentication of a client.
	dialTimeout = 5 * time.Second
	// keepAliveTime is how often gRPC pings an idle connection: its floor.
	keepAliveTime = 10 * time.Second
	// maxRereads bounds the hostnames Route reads from etcd at once.
	maxRereads = 64
)

// errStalled means etcd did not answer a call within CallTimeout on a
// stream that is still open: the member behind it may hang.
var errStalled = errors.New("registry: no answer from etcd within the call timeout")

// dial makes the etcd client. The endpoints are shuffled, so that edges do
// not all start on the first member.
func (s *Etcd) dial() (*clientv3.Client, error) {
	eps := slices.Clone(s.cfg.Endpoints)
	rand.Shuffle(len(eps), func(i, j int) { eps[i], eps[j] = eps[j], eps[i] })
	return clientv3.New(clientv3.Config{
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
// not, until ctx or the store operation's budget ends. call must be safe to
// repeat: a read, or a write whose repetition changes nothing.
func (s *Etcd) retry(ctx context.Context, call func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	for {
		err := s.once(ctx, call)
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

// spread runs call as retry does, each attempt on the next member in a
// turn of its own: the attempt after one that ran out goes to another
// member. It is for writes that are retried, not hedged. Through the
// client's balancer, which takes members in turn across every call, the
// attempts of one call fell in step with the confirm rounds' reads and
// their hedges, and went to a hung member time after time: one session
// record's put took 6.8 s of 1 s attempts with one member of three hung,
// until gRPC's keepalive dropped it.
func (s *Etcd) spread(ctx context.Context, call func(context.Context, *grpc.ClientConn) error) error {
	m := s.writerTurn()
	return s.retry(ctx, func(ctx context.Context) error {
		m++
		return s.onWriter(ctx, m-1, call)
	})
}

// writerTurn returns the member a write's first attempt goes to, each
// write's the next.
func (s *Etcd) writerTurn() int {
	s.writersMu.Lock()
	defer s.writersMu.Unlock()
	s.writers.turn++
	return s.writers.turn - 1
}

// onWriter runs call on spread's connection to member m (modulo their
// number); on none once Close has closed them.
func (s *Etcd) onWriter(ctx context.Context, m int, call func(context.Context, *grpc.ClientConn) error) error {
	s.writersMu.Lock()
	if s.writersClosed {
		s.writersMu.Unlock()
		return ErrUnavailable
	}
	conn, err := s.memberConn(&s.writers, m%len(s.cfg.Endpoints))
	s.writersMu.Unlock()
	if err != nil {
		return err
	}
	return call(ctx, conn)
}

// jitter returns d give or take a quarter, at random: loops that call etcd
// at fixed intervals fall into step with each other, and then with the
// balancer's turns (see confirmLoop).
func jitter(d time.Duration) time.Duration {
	return max(d*3/4+rand.N(d/2+1), time.Millisecond)
}

// get reads key (linearizable), hedged and retried.
func (s *Etcd) get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	// One Op for every attempt: options are closures that may write what
	// they captured (WithSort does), so they are applied once.
	resp, err := s.idempotent(ctx, clientv3.OpGet(key, opts...))
	return resp.Get(), err
}

// idempotent runs op, a read or a write whose repetition changes nothing,
// hedged and retried.
func (s *Etcd) idempotent(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	var resp clientv3.OpResponse
	err := s.retry(ctx, func(ctx context.Context) (err error) {
		resp, err = hedged(ctx, s.hedgeAfter(ctx), func(ctx context.Context) (clientv3.OpResponse, error) {
			return s.cli.Do(ctx, op)
		})
		return err
	})
	return resp, err
}

// txn sends op, a transaction guarded so that it applies at most once
// however often it is sent (a compare on the key's revision, and a value
// no other write carries), hedged like a read. An answer that does not
// settle it (an error, or a compare that failed, maybe because its hedge
// had applied it) is for the caller to read back.
func (s *Etcd) txn(ctx context.Context, op clientv3.Op) (*clientv3.TxnResponse, error) {
	var resp clientv3.OpResponse
	err := s.once(ctx, func(ctx context.Context) (err error) {
		resp, err = hedged(ctx, s.hedgeAfter(ctx), func(ctx context.Context) (clientv3.OpResponse, error) {
			return s.cli.Do(ctx, op)
		})
		return err
	})
	return resp.Txn(), err
}

// hedges is how many reads hedged runs at most for one answer: a second
// one when the first has had half of its time (hedgeAfter).
const hedges = 2

// hedgeAfter is when an attempt, whose deadline ctx carries, sends its
// hedge: after half of the time it has, a call timeout or less. A caller
// that allows less (a confirm round's read has half the route staleness,
// which may be shorter than a call timeout) still gets its hedge, where
// half a call timeout would come after its deadline: the rounds whose
// read went to a hung member all failed.
func (s *Etcd) hedgeAfter(ctx context.Context) time.Duration {
	d := s.callTimeout
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, time.Until(dl))
	}
	return d / 2
}

// hedged runs call, and again beside it every interval while no answer has
// come, up to hedges at once: the client sends each to the next member, so
// a member that holds calls without answering costs an interval, not a
// whole call timeout. The first answer wins; if every call fails, the last
// error is returned. call must be safe to repeat.
func hedged[T any](ctx context.Context, interval time.Duration, call func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }() // the losers end at once, canceled
	type result struct {
		v   T
		err error
	}
	results := make(chan result, hedges) // the losers' sends never block
	launch := func() {
		wg.Go(func() {
			v, err := call(ctx)
			results <- result{v, err}
		})
	}
	launch()
	t := time.NewTicker(max(interval, time.Millisecond))
	defer t.Stop()
	for launched, inflight := 1, 1; ; {
		select {
		case r := <-results:
			inflight--
			if r.err == nil || inflight == 0 && launched == hedges {
				return r.v, r.err
			}
			if inflight == 0 { // failed fast: no need to wait for the tick
				launch()
				launched, inflight = launched+1, 1
			}
		case <-t.C:
			if launched < hedges {
				launch()
				launched, inflight = launched+1, inflight+1
			}
		case <-ctx.Done():
			var zero T
			return zero, ctx.Err()
		}
	}
}

// transient reports whether err may pass on another attempt: a deadline,
// a member that is unreachable, leaderless, overloaded or broken (a member
// whose raft has stopped answers "raft: stopped", code Unknown). Errors
// that another member would repeat (a lease not found, a compacted
// revision, a refused password, a request too large) are not.
func transient(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errStalled) {
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

// grant obtains a lease with an ID of its own choosing, so that a grant
// sent again after a lost answer finds the lease the first one made
// instead of leaving it orphaned.
func (s *Etcd) grant(ctx context.Context, ttl int64) (clientv3.LeaseID, error) {
	id := rand.Int64N(math.MaxInt64-1) + 1
	lc := pb.NewLeaseClient(s.cli.ActiveConnection())
	sent := false
	err := s.retry(ctx, func(ctx context.Context) error {
		resp, err := lc.LeaseGrant(ctx, &pb.LeaseGrantRequest{TTL: ttl, ID: id}, grpc.WaitForReady(true))
		err = rpctypes.Error(err)
		switch {
		case err != nil && sent && errors.Is(err, rpctypes.ErrLeaseExist):
			return nil // an earlier attempt made it
		case err != nil:
			sent = sent || transient(err)
			return err
		case resp.Error != "":
			return errors.New(resp.Error)
		}
		return nil
	})
	return clientv3.LeaseID(id), err
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
		lease, err := s.grant(ctx, ttl)
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
	err := s.retry(ctx, func(ctx context.Context) error {
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
// RetryInterval. okSent is when the last answered renewal (or the grant)
// was sent.
func (s *Etcd) keepAlive(ctx context.Context, okSent time.Time) {
	defer s.wg.Done()
	for ctx.Err() == nil {
		lease, ready := s.currentLease()
		if !ready {
			okSent = s.regain(ctx, lease)
			continue
		}
		err := s.renew(ctx, lease, &okSent)
		if ctx.Err() != nil {
			return
		}
		s.lost(err)
	}
}

// errNotRenewed means no renewal was answered for two thirds of the TTL.
var errNotRenewed = errors.New("registry: no lease renewal answered for two thirds of the lease TTL")

// renew renews lease every fifth of the TTL on a keep-alive stream. When
// no stream has answered within CallTimeout, one more is opened (up to
// maxLanes) on a member that carries none of them, and every renewal goes
// out on each: a member that hangs stalls one stream and another answers.
// A slow stream is kept, since its late answers still count, until it
// fails or its oldest request is as old as the lease may go unrenewed.
// renew returns when the lease is lost (errNotRenewed) or gone
// (rpctypes.ErrLeaseNotFound), or ctx ends. *okSent is when the last
// answered renewal was sent: the lease lives at least LeaseTTL from then.
func (s *Etcd) renew(ctx context.Context, lease clientv3.LeaseID, okSent *time.Time) error {
	lostAfter := 2 * s.cfg.LeaseTTL / 3
	answers := make(chan answer)
	var wg sync.WaitGroup
	var lanes []*lane
	defer func() {
		for _, l := range lanes {
			l.close()
		}
		wg.Wait()
	}()
	every := time.NewTicker(s.cfg.LeaseTTL / 5)
	defer every.Stop()
	check := time.NewTicker(max(s.callTimeout/4, time.Millisecond))
	defer check.Stop()
	for {
		var opened bool
		lanes, opened = s.tendLanes(ctx, lanes, lostAfter, answers, &wg)
		send := opened
		select {
		case <-ctx.Done():
			return ctx.Err()
		case a := <-answers:
			if a.st != nil && a.err == nil {
				a.lane.opened(a.st, lease)
				break
			}
			first := !a.lane.heard
			sent, err := a.lane.answered(a)
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				return err
			}
			if err == nil && first {
				s.log.Debug("cluster lease lane answered", "member", s.cfg.Endpoints[a.lane.member])
			}
			if err == nil && sent.After(*okSent) {
				*okSent = sent
			}
		case <-every.C:
			send = true
		case <-check.C:
		}
		if send {
			now := time.Now()
			for _, l := range lanes {
				l.send(lease, now)
			}
		}
		if time.Since(*okSent) > lostAfter {
			return fmt.Errorf("%w: the last answered renewal was sent %v ago; lanes: %s",
				errNotRenewed, time.Since(*okSent).Round(time.Millisecond), s.describeLanes(lanes))
		}
	}
}

// describeLanes says where each lane is and how long its oldest renewal
// has gone unanswered, for the line that reports a lost lease.
func (s *Etcd) describeLanes(lanes []*lane) string {
	if len(lanes) == 0 {
		return "none open"
	}
	var out []string
	for _, l := range lanes {
		d := "all answered"
		switch {
		case l.failed:
			d = "failed"
		case l.st == nil:
			d = fmt.Sprintf("opening for %v", time.Since(l.sent[0]).Round(time.Millisecond))
		case len(l.sent) > 0:
			d = fmt.Sprintf("%d unanswered, the oldest for %v", len(l.sent), time.Since(l.sent[0]).Round(time.Millisecond))
		}
		out = append(out, s.cfg.Endpoints[l.member]+" ("+d+")")
	}
	return strings.Join(out, ", ")
}

// maxLanes bounds the keep-alive streams renew keeps open.
const maxLanes = 3

// tendLanes drops the lanes that failed or can no longer help, and opens
// one when none is left or none has answered within CallTimeout. opened
// reports a new lane, which wants a request at once.
func (s *Etcd) tendLanes(ctx context.Context, lanes []*lane, hopeless time.Duration, answers chan<- answer, wg *sync.WaitGroup) ([]*lane, bool) {
	keep := lanes[:0]
	fresh := false
	for _, l := range lanes {
		if l.failed || l.behind(hopeless) {
			s.log.Debug("cluster lease lane dropped", "member", s.cfg.Endpoints[l.member], "failed", l.failed, "unanswered", len(l.sent))
			l.close()
			continue
		}
		keep = append(keep, l)
		fresh = fresh || !l.behind(s.callTimeout)
	}
	lanes = keep
	if fresh {
		return lanes, false
	}
	if len(lanes) == maxLanes {
		i := longestBehind(lanes)
		lanes[i].close()
		lanes = slices.Delete(lanes, i, i+1)
	}
	l := s.openLane(ctx, s.nextMember(lanes), answers, wg)
	s.log.Debug("cluster lease lane opened", "member", s.cfg.Endpoints[l.member], "failed", l.failed, "lanes", len(lanes)+1)
	return append(lanes, l), true
}

// longestBehind returns the index of the lane to give up for a new one:
// of those that have not answered yet, if any, else of all, the one whose
// oldest unanswered request (or opening) is the oldest; each of lanes has
// one. Not the lane opened first, nor one merely longer behind than a
// lane still opening: that may be the only one answering, late.
func longestBehind(lanes []*lane) int {
	worse := func(a, b *lane) bool {
		if a.heard != b.heard {
			return !a.heard
		}
		return a.sent[0].Before(b.sent[0])
	}
	i := 0
	for j, l := range lanes {
		if worse(l, lanes[i]) {
			i = j
		}
	}
	return i
}

// members places streams of the store's own: a connection to each member
// alone (the client's Dial: its credentials, token and keepalive), made
// when a stream first goes there, and whose turn is next. The client's
// balanced connection cannot be told where a stream goes: it placed every
// new keep-alive lane on the hung member that held the lanes before it,
// until the lease was lost, and a new watch on the hung member its last
// one was silent on, round after round. The keep-alive lanes and the watch
// each have their own, which only their loop uses, and spread its own,
// under writersMu; Close closes the connections.
type members struct {
	conns []*grpc.ClientConn
	turn  int
}

// nextMember returns the member whose turn it is to carry a lane, passing
// over those that carry one of lanes already (they are behind, or no lane
// would be opened).
func (s *Etcd) nextMember(lanes []*lane) int {
	n := len(s.cfg.Endpoints)
	for i := range n {
		m := (s.members.turn + i) % n
		if !slices.ContainsFunc(lanes, func(l *lane) bool { return l.member == m }) {
			s.members.turn += i + 1
			return m
		}
	}
	m := s.members.turn % n
	s.members.turn++
	return m
}

// memberConn returns ms's connection to member m alone, made on first use
// (no I/O: gRPC connects when a stream needs it).
func (s *Etcd) memberConn(ms *members, m int) (*grpc.ClientConn, error) {
	if ms.conns == nil {
		ms.conns = make([]*grpc.ClientConn, len(s.cfg.Endpoints))
	}
	if ms.conns[m] == nil {
		c, err := s.cli.Dial(s.cfg.Endpoints[m])
		if err != nil {
			return nil, fmt.Errorf("registry: connect to %s: %w", s.cfg.Endpoints[m], err)
		}
		ms.conns[m] = c
	}
	return ms.conns[m], nil
}

// closeMembers closes the lanes', the watch's and spread's connections,
// once their loops have ended.
func (s *Etcd) closeMembers() {
	s.writersMu.Lock()
	s.writersClosed = true
	s.writersMu.Unlock()
	for _, c := range slices.Concat(s.members.conns, s.watchers.conns, s.writers.conns) {
		if c != nil {
			c.Close()
		}
	}
}

// lane is one keep-alive stream and the send times of its unanswered
// requests, oldest first (etcd answers a stream's requests in order).
// Only renew's loop touches a lane.
type lane struct {
	member int                           // its index in EtcdConfig.Endpoints
	st     pb.Lease_LeaseKeepAliveClient // nil while it opens
	cancel context.CancelFunc
	gone   chan struct{} // closed by close: its goroutine delivers nothing more
	closed bool
	sent   []time.Time
	heard  bool // it has answered a renewal
	failed bool
}

// answer is what a lane's stream delivered: its opening (st, or err) or
// an answer.
type answer struct {
	lane *lane
	st   pb.Lease_LeaseKeepAliveClient
	resp *pb.LeaseKeepAliveResponse
	err  error
}

// openLane opens a keep-alive stream on member m in the background: the
// lane counts its first request as sent now, and sends it once the stream
// has opened (opened). Opening may fetch an auth token, a call that a hung
// member would hold, and waits for the member's connection: bounded by a
// call timeout, after which the lane fails. It does not hold renew's loop:
// a loop held by each opening in turn took the answers of its one slow
// lane more slowly than it sent their requests, and declared its lease
// lost though every renewal was answered.
func (s *Etcd) openLane(ctx context.Context, m int, answers chan<- answer, wg *sync.WaitGroup) *lane {
	lctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	l := &lane{member: m, cancel: cancel, gone: make(chan struct{}), sent: []time.Time{time.Now()}}
	conn, err := s.memberConn(&s.members, m)
	if err != nil {
		cancel()
		l.failed = true
		return l
	}
	wg.Go(func() {
		opening := time.AfterFunc(s.callTimeout, cancel)
		st, err := pb.NewLeaseClient(conn).LeaseKeepAlive(lctx, grpc.WaitForReady(true))
		if !opening.Stop() && err == nil {
			err = fmt.Errorf("%w: opening a keep-alive stream", errStalled)
		}
		if !l.deliver(answers, answer{lane: l, st: st, err: err}) || err != nil {
			return
		}
		for {
			r, err := st.Recv()
			if !l.deliver(answers, answer{lane: l, resp: r, err: rpctypes.Error(err)}) || err != nil {
				return
			}
		}
	})
	return l
}

// deliver hands a to renew's loop, unless the lane was closed.
func (l *lane) deliver(answers chan<- answer, a answer) bool {
	select {
	case answers <- a:
		return true
	case <-l.gone:
		return false
	}
}

// opened takes the lane's stream and sends the request counted when the
// lane was opened.
func (l *lane) opened(st pb.Lease_LeaseKeepAliveClient, lease clientv3.LeaseID) {
	l.st = st
	if err := st.Send(&pb.LeaseKeepAliveRequest{ID: int64(lease)}); err != nil {
		l.failed = true
	}
}

// behind reports a request of the lane unanswered for longer than d.
func (l *lane) behind(d time.Duration) bool {
	return len(l.sent) > 0 && time.Since(l.sent[0]) > d
}

func (l *lane) send(lease clientv3.LeaseID, now time.Time) {
	if l.failed || l.st == nil { // an opening lane sends its request when open
		return
	}
	if err := l.st.Send(&pb.LeaseKeepAliveRequest{ID: int64(lease)}); err != nil {
		l.failed = true
		return
	}
	l.sent = append(l.sent, now)
}

// answered takes a's answer to the lane's oldest request and returns when
// that request was sent.
func (l *lane) answered(a answer) (time.Time, error) {
	switch {
	case a.err != nil:
		l.failed = true
		return time.Time{}, a.err
	case len(l.sent) == 0:
		return time.Time{}, errors.New("registry: a keep-alive answer to no request")
	case a.resp.TTL <= 0:
		return time.Time{}, rpctypes.ErrLeaseNotFound
	}
	sent := l.sent[0]
	l.sent, l.heard = l.sent[1:], true
	return sent, nil
}

func (l *lane) close() {
	l.cancel()
	if !l.closed {
		l.closed = true
		close(l.gone)
	}
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
