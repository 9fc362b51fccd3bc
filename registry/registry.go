// Package registry decides who owns a public hostname.
//
// A bind for a hostname that is already held is resolved by three rules, in
// order, atomically (a pool, which agents of one token ask for, is the one
// exception to rule 3: each member is an owner of its own, see Claim.Pool):
//
//  1. Same InstanceID and token: takeover at once, live holder or not.
//  2. Different instance, holder dead: takeover.
//  3. Different instance, holder live: refused with ErrTaken.
//
// Every successful bind or takeover gets a generation strictly greater than
// any the hostname had before; it is the fencing token. Release is
// compare-and-delete: it removes a binding only while the releasing session
// and generation still own it, so a late cleanup never removes a newer owner.
//
// A key claimed with Reserve (a public TCP port, "tcp:PORT") is also kept
// for its token while bound and for Reserve after its release: before the
// rules, a claim of another token is refused with ErrReserved, so that the
// token's restarted agent gets its port back (Reserver, in every store).
//
// Memory is the store of an edge that runs alone; it asks the edge whether
// a holder is live (LivenessFunc). Etcd is the store several edges share:
// the rules are etcd transactions, and a holder is live while its session
// key, on its edge's lease, exists. Its route cache answers only while
// etcd has confirmed it current within a bound (Etcd.Route), so no two
// edges route one hostname differently for longer than that.
package registry

import (
	"context"
	"errors"
	"time"
)

// Binding is one hostname's current owner.
type Binding struct {
	Hostname   string
	InstanceID string
	// TokenID identifies the token the owner presented (a digest, never the
	// secret). An instance id presented with another token is another instance.
	TokenID    string
	SessionID  uint64
	Node       string // the edge holding the session; empty on a single edge
	Generation uint64
	BoundAt    time.Time
	// LastHeard is when the holder was last known to be heard from, as a
	// store that outlives the edge (Bolt) keeps it: after a restart the
	// holder counts as live until its freshness window has passed since.
	// Zero in the other stores.
	LastHeard time.Time
	// Proto is what the hostname carries: "" for HTTP, "tls" for TLS
	// passed through to the agent by SNI.
	Proto string
	// Pool: the name is shared by Members, agents of TokenID that each
	// asked for a pool, each an owner with its own instance, session and
	// generation. The owner fields above are then empty, Generation is the
	// newest member's and BoundAt the oldest's.
	Pool    bool
	Members []Binding
	// Down is why a pool member's agent reports its local service down,
	// as the cluster's store keeps it for the other edges; "" when up,
	// and in the single-edge stores, whose edge asks the session.
	Down string
}

// Claim asks for a hostname on behalf of one session.
type Claim struct {
	Hostname   string
	InstanceID string
	TokenID    string
	SessionID  uint64
	Node       string
	// Exclusive binds only a hostname nobody holds, live or dead: used for
	// random names, which must never take anything over.
	Exclusive bool
	// Proto is the binding's Proto.
	Proto string
	// Pool joins the pool of the claimant's token that holds Hostname, or
	// starts one; only a claim with Pool joins a pool.
	Pool bool
	// Reserve, when positive, keeps Hostname for TokenID while it is bound
	// and for Reserve after its last release (a public TCP port): a claim
	// of another token is refused with ErrReserved meanwhile.
	Reserve time.Duration
	// Label is what the agent tunnels under this key (its local address or
	// tunnel name), so that the token's next agent asking with the same
	// label is given the same key back (Reserver.ReservedFor).
	Label string
}

// Outcome says which rule granted a bind.
type Outcome int

const (
	// Created: nobody held the hostname.
	Created Outcome = iota
	// SameInstance: rule 1, taken back by the instance that held it.
	SameInstance
	// DeadHolder: rule 2, taken from another instance whose holder was dead.
	DeadHolder
	// Unchanged: the claiming session already held it; nothing moved.
	Unchanged
	// Joined: another member of the pool was added.
	Joined
)

func (o Outcome) String() string {
	switch o {
	case Created:
		return "created"
	case SameInstance:
		return "same_instance"
	case DeadHolder:
		return "dead_holder"
	case Unchanged:
		return "unchanged"
	case Joined:
		return "joined"
	}
	return "unknown"
}

// Result is a granted bind.
type Result struct {
	Binding Binding
	// Previous is the binding that was replaced, when another session held
	// the hostname (a pool: each of its Owners): that session must be
	// evicted and fenced. Binding is then the claimant's own, a member.
	Previous *Binding
	Outcome  Outcome
}

// ErrTaken is returned by Bind when rule 3 refuses the claim.
var ErrTaken = errors.New("registry: hostname held by a live session of another instance")

// ErrReserved is returned by Bind when the key is reserved for another token.
var ErrReserved = errors.New("registry: reserved for another token")

// Reservation keeps a key for the token that last held it.
type Reservation struct {
	Key     string
	TokenID string
	Label   string
	// For is how long the key stays reserved after its release.
	For time.Duration
	// Until is when the reservation ends; zero while the key is bound.
	Until time.Time
}

// Reserver is a Store that keeps reservations (Memory, Bolt, Etcd).
type Reserver interface {
	// Reservation returns key's reservation while it is in force.
	Reservation(ctx context.Context, key string) (Reservation, bool, error)
	// ReservedFor returns the reservations in force of tokenID with label, sorted by key.
	ReservedFor(ctx context.Context, tokenID, label string) ([]Reservation, error)
}

// Store holds the bindings. Every method is safe for concurrent use and each
// applies the rules atomically.
type Store interface {
	// Bind applies the binding rules to c.
	Bind(ctx context.Context, c Claim) (Result, error)
	// Release deletes hostname only if sessionID at generation still owns
	// it. It reports whether it deleted anything; releasing twice is fine.
	Release(ctx context.Context, hostname string, sessionID, generation uint64) (bool, error)
	// Get returns the current binding of hostname.
	Get(ctx context.Context, hostname string) (Binding, bool, error)
	// List returns every binding, sorted by hostname.
	List(ctx context.Context) ([]Binding, error)
}

// LivenessFunc reports whether the holder of b is live at the time of the call.
type LivenessFunc func(b Binding) bool

// sameInstance is rule 1's test: instance and token both match.
func sameInstance(b Binding, c Claim) bool {
	return b.InstanceID != "" && b.InstanceID == c.InstanceID && b.TokenID == c.TokenID
}
