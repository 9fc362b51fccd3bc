package registry

import (
	"slices"
	"strings"
	"time"
)

// Every store keeps reservations.
var (
	_ Reserver = (*Memory)(nil)
	_ Reserver = (*Bolt)(nil)
	_ Reserver = (*Etcd)(nil)
)

// inForce reports whether r still keeps its key at now: while the key is
// bound (Until zero) or until Until has passed.
func (r Reservation) inForce(now time.Time) bool {
	return r.Until.IsZero() || r.Until.After(now)
}

// reservations holds a single-edge store's reservations by key, under the
// store's lock. The decisions are made here, the same for Memory and Bolt;
// each store applies them (Bolt once its transaction is durable). Etcd
// makes them on the one reservation it read (reserveRead.kept). Keyed by
// key, they never outnumber the keys ever bound with Reserve: a bind
// replaces the key's reservation, expired or not.
type reservations map[string]Reservation

// admit refuses c with ErrReserved when its key is reserved, in force, for
// another token. It comes before the binding rules, so that neither a dead
// holder nor a free key lets another token in; a claim without Reserve
// (a hostname) never sees reservations.
func (rs reservations) admit(c Claim, now time.Time) error {
	if c.Reserve <= 0 {
		return nil
	}
	if r, ok := rs[c.Hostname]; ok && r.inForce(now) && r.TokenID != c.TokenID {
		return ErrReserved
	}
	return nil
}

// bound is the reservation of c's key once c's bind has succeeded, and
// whether it differs from the one kept (so a store writes only a change).
func (rs reservations) bound(c Claim) (Reservation, bool) {
	if c.Reserve <= 0 {
		return Reservation{}, false
	}
	r := Reservation{Key: c.Hostname, TokenID: c.TokenID, Label: c.Label, For: c.Reserve}
	return r, rs[c.Hostname] != r
}

// released is key's reservation once its binding was deleted at now: it
// runs for its For from then. false when there is none to start (none, or
// one already running since an earlier release).
func (rs reservations) released(key string, now time.Time) (Reservation, bool) {
	r, ok := rs[key]
	if !ok || !r.Until.IsZero() {
		return Reservation{}, false
	}
	r.Until = now.Add(r.For)
	return r, true
}

// get returns key's reservation if it is in force at now.
func (rs reservations) get(key string, now time.Time) (Reservation, bool) {
	r, ok := rs[key]
	if !ok || !r.inForce(now) {
		return Reservation{}, false
	}
	return r, true
}

// of returns the reservations in force at now of tokenID with label,
// sorted by key.
func (rs reservations) of(tokenID, label string, now time.Time) []Reservation {
	var out []Reservation
	for _, r := range rs {
		if r.TokenID == tokenID && r.Label == label && r.inForce(now) {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b Reservation) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// prune drops the reservations that have expired at now.
func (rs reservations) prune(now time.Time) {
	for k, r := range rs {
		if !r.inForce(now) {
			delete(rs, k)
		}
	}
}
