package registry

import (
	"fmt"
	"slices"
	"time"
)

// ErrPooled is ErrTaken (rule 3) for a claim that cannot join the pool
// holding the name: it asked for no pool, or has another token.
var ErrPooled = fmt.Errorf("%w: a pool of agents", ErrTaken)

// ErrNotPooled is ErrTaken for a claim with Pool that meets a live holder
// which asked for no pool.
var ErrNotPooled = fmt.Errorf("%w: an agent that is not in a pool", ErrTaken)

// MaxPoolMembers bounds a pool's members: the cluster's store reads and
// writes them all in one etcd transaction, which etcd bounds (128
// operations by default).
const MaxPoolMembers = 50

// ErrPoolFull is ErrTaken for a claim that would be a pool's member past
// MaxPoolMembers.
var ErrPoolFull = fmt.Errorf("%w: a pool of %d agents, its most", ErrTaken, MaxPoolMembers)

// Owners returns the bindings that hold b's name: its members for a pool,
// else b itself.
func (b Binding) Owners() []Binding {
	if b.Pool {
		return b.Members
	}
	return []Binding{b}
}

// Member returns the owner of b's name that holds generation gen.
func (b Binding) Member(gen uint64) (Binding, bool) {
	for _, m := range b.Owners() {
		if m.Generation == gen {
			return m, true
		}
	}
	return Binding{}, false
}

// bindLocal applies the binding rules to c against old (held: the name is
// bound) for the single-edge stores: next is what the name holds after,
// gen the generation a new owner gets, heard its LastHeard. A pool is one exception to rule 3,
// asked for by both sides: a claim with Pool joins a pool of its own token
// as a member of its own; rules 1 and 2 then apply member by member.
func bindLocal(old Binding, held bool, c Claim, live LivenessFunc, gen uint64, now, heard time.Time) (next Binding, res Result, err error) {
	mine := Binding{Hostname: c.Hostname, InstanceID: c.InstanceID, TokenID: c.TokenID,
		SessionID: c.SessionID, Node: c.Node, Generation: gen, BoundAt: now, LastHeard: heard, Proto: c.Proto}
	if !held || !old.Pool && !c.Pool {
		outcome, err := decide(old, held, c, live)
		if err != nil || outcome == Unchanged {
			return old, Result{Binding: old, Outcome: outcome}, err
		}
		res = Result{Binding: mine, Outcome: outcome}
		if held {
			res.Previous = &old
		}
		return pooled(mine, c.Pool), res, nil
	}
	if c.Exclusive {
		return old, Result{}, ErrTaken
	}
	if old.Pool && c.Pool && old.TokenID == c.TokenID && old.Proto == c.Proto {
		for i, m := range old.Members {
			if !sameInstance(m, c) {
				continue
			}
			if m.SessionID == c.SessionID && m.Node == c.Node {
				return old, Result{Binding: m, Outcome: Unchanged}, nil
			}
			next = old
			next.Members = slices.Clone(old.Members)
			next.Members[i] = mine
			return sealPool(next), Result{Binding: mine, Outcome: SameInstance, Previous: &m}, nil
		}
		if len(old.Members) >= MaxPoolMembers {
			return old, Result{}, ErrPoolFull
		}
		next = old
		next.Members = append(slices.Clone(old.Members), mine)
		return sealPool(next), Result{Binding: mine, Outcome: Joined}, nil
	}
	// A pool against a single holder, or a pool of another token or
	// proto: the name changes hands only when every owner but the
	// claimant's own instance is dead (rules 1 and 2 together).
	outcome := DeadHolder
	for _, m := range old.Owners() {
		if sameInstance(m, c) {
			outcome = SameInstance
			continue
		}
		if live(m) {
			if old.Pool {
				return old, Result{}, ErrPooled
			}
			return old, Result{}, ErrNotPooled
		}
	}
	if len(old.Owners()) > 1 {
		outcome = DeadHolder
	}
	return pooled(mine, c.Pool), Result{Binding: mine, Outcome: outcome, Previous: &old}, nil
}

// pooled is b as the name's binding: b alone, or a pool of b.
func pooled(b Binding, pool bool) Binding {
	if !pool {
		return b
	}
	return sealPool(Binding{Hostname: b.Hostname, TokenID: b.TokenID, Proto: b.Proto, Pool: true, Members: []Binding{b}})
}

// sealPool sets what a pool's binding says of its members: its newest
// generation and its first bind.
func sealPool(p Binding) Binding {
	p.Generation, p.BoundAt = 0, time.Time{}
	for _, m := range p.Members {
		p.Generation = max(p.Generation, m.Generation)
		if p.BoundAt.IsZero() || m.BoundAt.Before(p.BoundAt) {
			p.BoundAt = m.BoundAt
		}
	}
	return p
}

// releaseLocal removes the owner of b at (session, generation): next is
// what the name holds after, gone whether it is free now, ok whether
// anything was removed.
func releaseLocal(b Binding, sessionID, generation uint64) (next Binding, gone, ok bool) {
	if !b.Pool {
		ok = b.SessionID == sessionID && b.Generation == generation
		return Binding{}, ok, ok
	}
	i := slices.IndexFunc(b.Members, func(m Binding) bool { return m.SessionID == sessionID && m.Generation == generation })
	if i < 0 {
		return b, false, false
	}
	if len(b.Members) == 1 {
		return Binding{}, true, true
	}
	next = b
	next.Members = slices.Delete(slices.Clone(b.Members), i, i+1)
	return sealPool(next), false, true
}
