package registry

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Reservations in etcd, under reserved/KEY, decided by the same rules as
// on one edge (reservations). A reservation is in force until its Until;
// one with no Until is held, and in force while its key is bound. The edge
// whose Release deletes the binding starts its clock; a binding that its
// edge's lease removed had no Release, so the first store to read the
// reservation after starts it (readReservation): every edge then judges
// it by the same Until.

// reserveRead is a key's reservation as read, at revision rev (zero: none).
type reserveRead struct {
	r   Reservation
	rev int64
}

// kept is rr as the single-edge stores keep reservations, so that the
// decisions are theirs.
func (rr reserveRead) kept() reservations {
	if rr.rev == 0 {
		return reservations{}
	}
	return reservations{rr.r.Key: rr.r}
}

// unchanged is the compare that holds while the reservation is as read.
func (rr reserveRead) unchanged(rkey string) clientv3.Cmp {
	if rr.rev == 0 {
		return clientv3.Compare(clientv3.CreateRevision(rkey), "=", 0)
	}
	return clientv3.Compare(clientv3.ModRevision(rkey), "=", rr.rev)
}

func encodeReservation(r Reservation) []byte {
	v, _ := json.Marshal(reservationRecord{TokenID: r.TokenID, Label: r.Label, For: r.For, Until: r.Until})
	return v
}

func decodeReservation(key string, val []byte) (Reservation, error) {
	var r reservationRecord
	if err := json.Unmarshal(val, &r); err != nil || r.For <= 0 {
		return Reservation{}, fmt.Errorf("registry: reservation of %s in etcd is not valid: %q", key, val)
	}
	return Reservation{Key: key, TokenID: r.TokenID, Label: r.Label, For: r.For, Until: r.Until}, nil
}

// clock reads the reservations' clock.
func (s *Etcd) clock() time.Time {
	s.mu.Lock()
	now := s.now
	s.mu.Unlock()
	return now()
}

// readReservation reads key's reservation and, in the same read, whether
// key is bound: one held whose binding is gone gets its clock started
// first, so that a reservation it returns with no Until was bound when read.
func (s *Etcd) readReservation(ctx context.Context, key string) (reserveRead, error) {
	read := clientv3.OpTxn(nil, []clientv3.Op{
		clientv3.OpGet(s.reserveKey(key)), clientv3.OpGet(s.hostKey(key), clientv3.WithCountOnly()),
		clientv3.OpGet(s.memberPrefix(key), clientv3.WithPrefix(), clientv3.WithCountOnly())}, nil)
	for range bindAttempts {
		resp, err := s.idempotent(ctx, read)
		if err != nil {
			return reserveRead{}, err
		}
		got := resp.Txn().Responses
		kvs := got[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			return reserveRead{}, nil
		}
		rr := reserveRead{rev: kvs[0].ModRevision}
		if rr.r, err = decodeReservation(key, kvs[0].Value); err != nil {
			return reserveRead{}, err
		}
		if !rr.r.Until.IsZero() || got[1].GetResponseRange().GetCount()+got[2].GetResponseRange().GetCount() > 0 {
			return rr, nil
		}
		started, ok, err := s.startClock(ctx, rr)
		if ok || err != nil && !transient(err) {
			return started, err
		}
		// Changed since the read, or the answer was lost: read it again.
	}
	return reserveRead{}, fmt.Errorf("%w: reservation of %s: %d attempts lost to concurrent writers", ErrUnavailable, key, bindAttempts)
}

// startClock writes rr's reservation, held, as released now: it runs for
// its For from now. Guarded, it applies only while the reservation is as
// read and its key unbound; ok reports that it did.
func (s *Etcd) startClock(ctx context.Context, rr reserveRead) (reserveRead, bool, error) {
	key := rr.r.Key
	started, _ := rr.kept().released(key, s.clock())
	rkey := s.reserveKey(key)
	tr, err := s.txn(ctx, clientv3.OpTxn(
		[]clientv3.Cmp{rr.unchanged(rkey), clientv3.Compare(clientv3.CreateRevision(s.hostKey(key)), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(s.memberPrefix(key)), "=", 0).WithPrefix()},
		[]clientv3.Op{clientv3.OpPut(rkey, string(encodeReservation(started)))}, nil))
	if err != nil || !tr.Succeeded {
		return reserveRead{}, false, err
	}
	return reserveRead{r: started, rev: tr.Header.Revision}, true, nil
}

// startReservation starts the clock of the reservation (kvs, as the
// release that deleted key's binding read it), if it is held. Best effort:
// one this misses (the write failed, or the release's answer was lost) is
// started when next read, a little later than the release.
func (s *Etcd) startReservation(ctx context.Context, key string, kvs []*mvccpb.KeyValue) {
	if len(kvs) == 0 {
		return
	}
	r, err := decodeReservation(key, kvs[0].Value)
	if err != nil || !r.Until.IsZero() {
		return
	}
	if _, ok, err := s.startClock(ctx, reserveRead{r: r, rev: kvs[0].ModRevision}); !ok {
		s.log.Debug("cluster: reservation not started at release; it starts when next read", "key", key, "err", err)
	}
}

// Reservation returns key's reservation while it is in force.
func (s *Etcd) Reservation(ctx context.Context, key string) (Reservation, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	rr, err := s.readReservation(ctx, key)
	if err != nil {
		return Reservation{}, false, fmt.Errorf("registry: reservation %s: %w", key, err)
	}
	r, ok := rr.kept().get(key, s.clock())
	return r, ok, nil
}

// ReservedFor returns tokenID's reservations in force with label, sorted
// by key: one read of every reservation, and one more of each held one
// of tokenID with label, to learn whether its key is still bound.
func (s *Etcd) ReservedFor(ctx context.Context, tokenID, label string) ([]Reservation, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opBudget)
	defer cancel()
	prefix := s.reserveKey("")
	resp, err := s.get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("registry: reservations: %w", err)
	}
	rs := reservations{}
	for _, kv := range resp.Kvs {
		key := strings.TrimPrefix(string(kv.Key), prefix)
		r, err := decodeReservation(key, kv.Value)
		if err != nil {
			return nil, err
		}
		if r.TokenID != tokenID || r.Label != label {
			continue
		}
		if r.Until.IsZero() {
			rr, err := s.readReservation(ctx, key)
			if err != nil {
				return nil, fmt.Errorf("registry: reservations: %w", err)
			}
			if rr.rev == 0 {
				continue // deleted since
			}
			r = rr.r
		}
		rs[key] = r
	}
	return rs.of(tokenID, label, s.clock()), nil
}
