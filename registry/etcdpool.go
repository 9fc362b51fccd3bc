package registry

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Pools in the cluster. A pool's members are keys of their own,
//
//	members/HOSTNAME/NODE/SESSION  the member's record (JSON), with "down"
//
// each on its own edge's lease, so an edge that dies or is cut off takes
// its members with it and no other. hosts/HOSTNAME and members/HOSTNAME/
// never both hold keys: each transaction that writes one guards the
// other. A member's generation is its key's CreateRevision, so that its
// health, rewritten in place (SetDown), leaves the fencing token as it was.

// memberRecord is a pool member as stored in etcd.
type memberRecord struct {
	record
	Down string `json:"down,omitempty"`
}

func (s *Etcd) memberPrefix(h string) string { return s.cfg.Prefix + "members/" + h + "/" }
func (s *Etcd) memberKey(h, node string, id uint64) string {
	return s.memberPrefix(h) + memberID(node, id)
}

// memberID names a member within its pool: its edge and session.
func memberID(node string, id uint64) string { return node + "/" + strconv.FormatUint(id, 10) }

// splitMember splits a key under members/ (without that prefix) into its
// hostname and member id; hostnames hold no '/'.
func splitMember(k string) (host, id string, ok bool) {
	host, id, ok = strings.Cut(k, "/")
	return host, id, ok && host != "" && id != ""
}

func (s *Etcd) decodeMember(hostname string, kv *mvccpb.KeyValue) (Binding, error) {
	var r memberRecord
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		return Binding{}, fmt.Errorf("registry: pool member of %s in etcd is not valid: %w", hostname, err)
	}
	return Binding{Hostname: hostname, InstanceID: r.InstanceID, TokenID: r.TokenID, SessionID: r.SessionID,
		Node: r.Node, Generation: uint64(kv.CreateRevision), BoundAt: r.BoundAt, Proto: r.Proto, Down: r.Down}, nil
}

func encodeMember(b Binding) string {
	val, _ := json.Marshal(memberRecord{record: record{InstanceID: b.InstanceID, TokenID: b.TokenID,
		SessionID: b.SessionID, Node: b.Node, BoundAt: b.BoundAt, Proto: b.Proto}, Down: b.Down})
	return string(val)
}

// poolOf is a pool's binding from its members, in the order they joined.
func poolOf(hostname string, members []Binding) Binding {
	slices.SortFunc(members, func(a, b Binding) int { return cmp.Compare(a.Generation, b.Generation) })
	return sealPool(Binding{Hostname: hostname, TokenID: members[0].TokenID, Proto: members[0].Proto, Pool: true, Members: members})
}

// nameState is what one read found of a hostname: its single binding, or
// the members of its pool.
type nameState struct {
	single  held
	members []memberAt
	rev     int64 // the read's revision
}

type memberAt struct {
	b   Binding
	key string
	mod int64
}

// binding is the state as the single-edge stores hold it.
func (st nameState) binding() (Binding, bool) {
	if st.single.ok {
		return st.single.b, true
	}
	if len(st.members) == 0 {
		return Binding{}, false
	}
	ms := make([]Binding, len(st.members))
	for i, m := range st.members {
		ms[i] = m.b
	}
	return poolOf(st.single.b.Hostname, ms), true
}

// readName reads hostname's binding and pool members at one revision.
func (s *Etcd) readName(ctx context.Context, h string) (nameState, error) {
	resp, err := s.idempotent(ctx, clientv3.OpTxn(nil, []clientv3.Op{
		clientv3.OpGet(s.hostKey(h)), clientv3.OpGet(s.memberPrefix(h), clientv3.WithPrefix())}, nil))
	if err != nil {
		return nameState{}, err
	}
	tr := resp.Txn()
	st := nameState{rev: tr.Header.Revision}
	st.single.b.Hostname = h
	if kvs := tr.Responses[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
		if st.single.b, err = s.decode(h, kvs[0].Value, kvs[0].ModRevision); err != nil {
			return nameState{}, err
		}
		st.single.ok, st.single.rev = true, kvs[0].ModRevision
	}
	for _, kv := range tr.Responses[1].GetResponseRange().GetKvs() {
		b, err := s.decodeMember(h, kv)
		if err != nil {
			return nameState{}, err
		}
		st.members = append(st.members, memberAt{b: b, key: string(kv.Key), mod: kv.ModRevision})
	}
	return st, nil
}

// liveSessions reads which of bs's sessions are live (their session key
// exists), in one read.
func (s *Etcd) liveSessions(ctx context.Context, bs []Binding) (map[string]bool, error) {
	ops := make([]clientv3.Op, len(bs))
	for i, b := range bs {
		ops[i] = clientv3.OpGet(s.sessionKey(b.Node, b.SessionID), clientv3.WithCountOnly())
	}
	resp, err := s.idempotent(ctx, clientv3.OpTxn(nil, ops, nil))
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	for i, b := range bs {
		live[memberID(b.Node, b.SessionID)] = resp.Txn().Responses[i].GetResponseRange().GetCount() > 0
	}
	return live, nil
}

// tryPool applies the rules to a claim with Pool, or to any claim for a
// name a pool holds, against st: the single-edge stores' decision
// (bindLocal) on the state read, committed while the name, its members
// and the reservation are as read and each owner found dead still is.
func (s *Etcd) tryPool(ctx context.Context, c Claim, lease clientv3.LeaseID, st nameState, rr reserveRead) (Result, bool, error) {
	old, isHeld := st.binding()
	owners := []Binding(nil)
	if isHeld {
		owners = old.Owners()
	}
	live, err := s.liveSessions(ctx, owners)
	if err != nil {
		return Result{}, true, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
	}
	now := time.Now().UTC().Round(0)
	next, res, err := bindLocal(old, isHeld, c, func(b Binding) bool { return live[memberID(b.Node, b.SessionID)] }, 0, now, time.Time{})
	if err != nil {
		return Result{}, true, err
	}
	key, prefix := s.hostKey(c.Hostname), s.memberPrefix(c.Hostname)
	// Nothing under the pool's prefix written since the read: no member
	// added, none rewritten.
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(prefix), "<", st.rev+1).WithPrefix()}
	if st.single.ok {
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(key), "=", st.single.rev))
	} else {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(key), "=", 0))
	}
	var ops []clientv3.Op
	r, reserve := rr.kept().bound(c)
	if c.Reserve > 0 {
		rkey := s.reserveKey(c.Hostname)
		cmps = append(cmps, rr.unchanged(rkey))
		if reserve {
			ops = append(ops, clientv3.OpPut(rkey, string(encodeReservation(r))))
		}
	}
	if res.Outcome == Unchanged {
		if !reserve {
			return res, true, nil
		}
		tr, err := s.txn(ctx, clientv3.OpTxn(cmps, ops, nil))
		if err != nil && !transient(err) {
			return Result{}, true, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
		}
		return res, err == nil && tr.Succeeded, nil
	}
	kept := map[uint64]bool{}
	for _, m := range next.Owners() {
		kept[m.Generation] = true
	}
	// What goes: the single holder or members the claim replaces. One
	// that is not the claimant's instance was found dead: it must still be.
	var gone []memberAt
	if st.single.ok && !kept[st.single.b.Generation] {
		ops = append(ops, clientv3.OpDelete(key))
		if !sameInstance(st.single.b, c) {
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(s.sessionKey(st.single.b.Node, st.single.b.SessionID)), "=", 0))
		}
	}
	for _, m := range st.members {
		if kept[m.b.Generation] {
			continue
		}
		gone = append(gone, m)
		ops = append(ops, clientv3.OpDelete(m.key))
		if !sameInstance(m.b, c) {
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(s.sessionKey(m.b.Node, m.b.SessionID)), "=", 0))
		}
	}
	mine := Binding{Hostname: c.Hostname, InstanceID: c.InstanceID, TokenID: c.TokenID,
		SessionID: c.SessionID, Node: c.Node, BoundAt: now, Proto: c.Proto}
	mkey := s.memberKey(c.Hostname, c.Node, c.SessionID)
	var val string
	if next.Pool {
		val = encodeMember(mine)
		ops = append(ops, clientv3.OpPut(mkey, val, clientv3.WithLease(lease)))
	} else {
		v, _ := json.Marshal(record{InstanceID: mine.InstanceID, TokenID: mine.TokenID, SessionID: mine.SessionID, Node: mine.Node, BoundAt: mine.BoundAt, Proto: mine.Proto})
		val = string(v)
		ops = append(ops, clientv3.OpPut(key, val, clientv3.WithLease(lease)))
	}
	tr, err := s.txn(ctx, clientv3.OpTxn(cmps, ops, nil))
	if err != nil && !transient(err) {
		return Result{}, true, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
	}
	if err != nil || !tr.Succeeded {
		// Applied or not: read the key the claim writes, never resend.
		at := mkey
		if !next.Pool {
			at = key
		}
		resp, rerr := s.get(ctx, at)
		switch {
		case rerr != nil:
			return Result{}, true, fmt.Errorf("registry: bind %s: read back: %w", c.Hostname, rerr)
		case !holds(resp, []byte(val)):
			return Result{}, false, nil
		}
		tr = &clientv3.TxnResponse{Header: resp.Header}
		tr.Header.Revision = resp.Kvs[0].ModRevision
	}
	rev := tr.Header.Revision
	mine.Generation = uint64(rev)
	s.mu.Lock()
	var lost []Binding
	if st.single.ok && !kept[st.single.b.Generation] {
		lost = append(lost, s.applyLocked(c.Hostname, nil, rev)...)
	}
	for _, m := range gone {
		lost = append(lost, s.applyMemberLocked(c.Hostname, memberID(m.b.Node, m.b.SessionID), nil, rev)...)
	}
	if next.Pool {
		lost = append(lost, s.applyMemberLocked(c.Hostname, memberID(c.Node, c.SessionID), &mine, rev)...)
	} else {
		lost = append(lost, s.applyLocked(c.Hostname, &mine, rev)...)
	}
	s.mu.Unlock()
	s.takenOver(lost)
	res.Binding = mine
	return res, true, nil
}

// releaseMember deletes the pool member of hostname at (this node's
// session, generation), as Release does a binding. The last member's
// release starts the name's reservation.
func (s *Etcd) releaseMember(ctx context.Context, hostname string, sessionID uint64, gen int64) (bool, error) {
	if gen <= 0 {
		return false, nil // a CreateRevision of 0 is an absent key's
	}
	mkey := s.memberKey(hostname, s.cfg.Node, sessionID)
	for sent := false; ; {
		// The reads after the delete see it: the count is of the others.
		tr, err := s.txn(ctx, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(mkey), "=", gen)},
			[]clientv3.Op{clientv3.OpDelete(mkey), clientv3.OpGet(s.memberPrefix(hostname), clientv3.WithPrefix(), clientv3.WithCountOnly()), clientv3.OpGet(s.reserveKey(hostname))},
			[]clientv3.Op{clientv3.OpGet(mkey, clientv3.WithKeysOnly())}))
		switch {
		case err != nil && !transient(err):
			return false, fmt.Errorf("registry: release %s: %w", hostname, err)
		case err == nil && tr.Succeeded:
			s.mu.Lock()
			lost := s.applyMemberLocked(hostname, memberID(s.cfg.Node, sessionID), nil, tr.Header.Revision)
			s.mu.Unlock()
			s.takenOver(lost)
			if tr.Responses[1].GetResponseRange().GetCount() == 0 {
				s.startReservation(ctx, hostname, tr.Responses[2].GetResponseRange().GetKvs())
			}
			return true, nil
		case err == nil:
			// Not at gen: a delete of this call whose answer was lost
			// removed it, or it was never this call's to remove.
			return sent && len(tr.Responses[0].GetResponseRange().GetKvs()) == 0, nil
		}
		sent = true
		if ctx.Err() != nil {
			return false, fmt.Errorf("registry: release %s: %w", hostname, ctx.Err())
		}
	}
}

// SetDown records the health of this node's pool member of hostname at
// (session, generation): why its agent reports its local service down,
// "" when up. Other edges then route around it. A member gone is left so.
func (s *Etcd) SetDown(ctx context.Context, hostname string, sessionID, generation uint64, down string) error {
	lease, ready := s.currentLease()
	if !ready {
		return ErrUnavailable
	}
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	mkey := s.memberKey(hostname, s.cfg.Node, sessionID)
	for range bindAttempts {
		resp, err := s.get(ctx, mkey)
		if err != nil {
			return fmt.Errorf("registry: health of %s: %w", hostname, err)
		}
		if len(resp.Kvs) == 0 || uint64(resp.Kvs[0].CreateRevision) != generation {
			return nil
		}
		b, err := s.decodeMember(hostname, resp.Kvs[0])
		if err != nil || b.Down == down {
			return err
		}
		b.Down = down
		tr, err := s.txn(ctx, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(mkey), "=", resp.Kvs[0].ModRevision)},
			[]clientv3.Op{clientv3.OpPut(mkey, encodeMember(b), clientv3.WithLease(lease))}, nil))
		switch {
		case err != nil && !transient(err):
			return fmt.Errorf("registry: health of %s: %w", hostname, err)
		case err == nil && tr.Succeeded:
			s.mu.Lock()
			lost := s.applyMemberLocked(hostname, memberID(s.cfg.Node, sessionID), &b, tr.Header.Revision)
			s.mu.Unlock()
			s.takenOver(lost)
			return nil
		}
		// Lost or raced: the next read says what stands.
	}
	return fmt.Errorf("registry: health of %s: %w: %d attempts lost to concurrent writers", hostname, ErrUnavailable, bindAttempts)
}

// applyMemberLocked records member id of host's pool at revision rev (b
// nil: deleted), unless the cache knows a later state of it, and seals the
// pool's binding again. It returns the bindings of this node the change
// ended. A single binding the cache holds from before rev is gone: a
// member is written only where none is.
func (s *Etcd) applyMemberLocked(host, id string, b *Binding, rev int64) []Binding {
	tk := "members/" + host + "/" + id // no hostname holds a '/'
	if t, ok := s.tombs[tk]; ok && rev <= t.rev {
		return nil
	}
	cur, had := s.pools[host][id]
	if had && rev <= cur.mod {
		return nil
	}
	var lost []Binding
	if b != nil {
		if one, ok := s.routes[host]; ok && !one.Pool {
			if int64(one.Generation) >= rev {
				return nil
			}
			delete(s.routes, host)
			if one.Node == s.cfg.Node {
				lost = append(lost, one)
			}
		}
		if s.pools[host] == nil {
			s.pools[host] = map[string]memberAt{}
		}
		s.pools[host][id] = memberAt{b: *b, mod: rev}
	} else {
		delete(s.pools[host], id)
		s.tombs[tk] = tomb{rev: rev, at: time.Now()}
		if had && cur.b.Node == s.cfg.Node {
			lost = append(lost, cur.b)
		}
	}
	s.sealLocked(host)
	return lost
}

// sealLocked sets host's route to its pool as the cache holds it.
func (s *Etcd) sealLocked(host string) {
	ms := s.pools[host]
	if len(ms) == 0 {
		delete(s.pools, host)
		if b, ok := s.routes[host]; ok && b.Pool {
			delete(s.routes, host)
		}
		return
	}
	bs := make([]Binding, 0, len(ms))
	for _, m := range ms {
		bs = append(bs, m.b)
	}
	s.routes[host] = poolOf(host, bs)
}

// dropPoolLocked removes host's pool from the cache as of rev: a single
// binding was written then, which only a transaction that deleted every
// member does. It returns this node's members.
func (s *Etcd) dropPoolLocked(host string, rev int64) []Binding {
	var lost []Binding
	for id, m := range s.pools[host] {
		s.tombs["members/"+host+"/"+id] = tomb{rev: rev, at: time.Now()}
		if m.b.Node == s.cfg.Node {
			lost = append(lost, m.b)
		}
	}
	delete(s.pools, host)
	delete(s.routes, host)
	return lost
}

// poolRevLocked is the latest revision the cache holds of host's members.
func (s *Etcd) poolRevLocked(host string) int64 {
	var rev int64
	for _, m := range s.pools[host] {
		rev = max(rev, m.mod)
	}
	return rev
}

// applyStateLocked brings the cache up to st, a read of host at st.rev.
func (s *Etcd) applyStateLocked(host string, st nameState) []Binding {
	var lost []Binding
	if st.single.ok {
		lost = s.applyLocked(host, &st.single.b, st.single.rev)
	} else {
		lost = s.applyLocked(host, nil, st.rev)
	}
	seen := map[string]bool{}
	for _, m := range st.members {
		id := memberID(m.b.Node, m.b.SessionID)
		seen[id] = true
		lost = append(lost, s.applyMemberLocked(host, id, &m.b, m.mod)...)
	}
	for id := range s.pools[host] {
		if !seen[id] {
			lost = append(lost, s.applyMemberLocked(host, id, nil, st.rev)...)
		}
	}
	return lost
}
