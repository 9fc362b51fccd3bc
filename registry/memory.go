package registry

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// Memory is the single-edge Store: a map under one mutex.
type Memory struct {
	live LivenessFunc
	now  func() time.Time

	mu       sync.Mutex
	bindings map[string]Binding
	reserved reservations
	// lastGen is shared by all hostnames, so a hostname released and bound
	// again still gets a generation above every earlier one.
	lastGen uint64
}

// NewMemory returns an empty store. live answers rule 2 versus rule 3; a nil
// live treats every holder as live.
func NewMemory(live LivenessFunc) *Memory {
	if live == nil {
		live = func(Binding) bool { return true }
	}
	return &Memory{live: live, now: time.Now, bindings: make(map[string]Binding), reserved: reservations{}}
}

// Bind applies the key's reservation and then the binding rules to c
// under the store's lock. The liveness function is called with the lock
// held, so it must not call back into m.
func (m *Memory) Bind(_ context.Context, c Claim) (Result, error) {
	if c.Hostname == "" {
		return Result{}, fmt.Errorf("registry: bind: empty hostname")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	if err := m.reserved.admit(c, now); err != nil {
		return Result{}, err
	}
	old, held := m.bindings[c.Hostname]
	next, res, err := bindLocal(old, held, c, m.live, m.lastGen+1, now, time.Time{})
	if err != nil {
		return Result{}, err
	}
	if r, changed := m.reserved.bound(c); changed {
		m.reserved[c.Hostname] = r
	}
	if res.Outcome != Unchanged {
		m.lastGen++
		m.bindings[c.Hostname] = next
	}
	return res, nil
}

// decide applies the binding rules to c against old, the binding held now
// (if held), asking live about a holder of another instance.
func decide(old Binding, held bool, c Claim, live LivenessFunc) (Outcome, error) {
	switch {
	case !held:
		return Created, nil
	case c.Exclusive:
		return 0, ErrTaken
	case old.SessionID == c.SessionID && old.Node == c.Node && sameInstance(old, c):
		return Unchanged, nil
	case sameInstance(old, c):
		return SameInstance, nil
	case !live(old):
		return DeadHolder, nil
	}
	return 0, ErrTaken
}

// Release is compare-and-delete on (session, generation); a deletion
// starts the key's reservation running.
func (m *Memory) Release(_ context.Context, hostname string, sessionID, generation uint64) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.bindings[hostname]
	if !ok {
		return false, nil
	}
	next, gone, ok := releaseLocal(b, sessionID, generation)
	switch {
	case !ok:
		return false, nil
	case !gone:
		m.bindings[hostname] = next
		return true, nil
	}
	delete(m.bindings, hostname)
	if r, changed := m.reserved.released(hostname, m.now()); changed {
		m.reserved[hostname] = r
	}
	return true, nil
}

// Reservation returns key's reservation while it is in force.
func (m *Memory) Reservation(_ context.Context, key string) (Reservation, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.reserved.get(key, m.now())
	return r, ok, nil
}

// ReservedFor returns tokenID's reservations in force with label, sorted
// by key; it drops the expired ones on the way.
func (m *Memory) ReservedFor(_ context.Context, tokenID, label string) ([]Reservation, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	m.reserved.prune(now)
	return m.reserved.of(tokenID, label, now), nil
}

// Get returns hostname's binding.
func (m *Memory) Get(_ context.Context, hostname string) (Binding, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.bindings[hostname]
	return b, ok, nil
}

// List returns every binding sorted by hostname.
func (m *Memory) List(context.Context) ([]Binding, error) {
	m.mu.Lock()
	out := make([]Binding, 0, len(m.bindings))
	for _, b := range m.bindings {
		out = append(out, b)
	}
	m.mu.Unlock()
	slices.SortFunc(out, func(a, b Binding) int { return strings.Compare(a.Hostname, b.Hostname) })
	return out, nil
}
