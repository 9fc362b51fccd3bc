package registry_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"path/filepath"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/ngstone/ngstone/registry"
)

// reserveStore is a store that keeps reservations, with a clock a test moves.
type reserveStore interface {
	registry.Store
	registry.Reserver
	SetClock(func() time.Time)
}

// reserveStores makes each store that keeps reservations, its holders'
// liveness following l (for etcd, its session keys: a holder is dead once
// its session is closed).
var reserveStores = map[string]func(t *testing.T, l *liveness) reserveStore{
	"memory": func(t *testing.T, l *liveness) reserveStore { return registry.NewMemory(l.live) },
	"etcd":   func(t *testing.T, l *liveness) reserveStore { return newEtcdNodes(t, l) },
	"bolt": func(t *testing.T, l *liveness) reserveStore {
		s, err := registry.OpenBolt(filepath.Join(t.TempDir(), "registry.db"), l.live)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	},
}

// clock is a test's time: it moves only when told.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

var epoch = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// newClock starts s's clock at epoch.
func newClock(s reserveStore) *clock {
	c := &clock{t: epoch}
	s.SetClock(c.now)
	return c
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// forReserveStores runs fn against a fresh store of each kind that keeps
// reservations.
func forReserveStores(t *testing.T, fn func(t *testing.T, s reserveStore, l *liveness, c *clock)) {
	for name, newStore := range reserveStores {
		t.Run(name, func(t *testing.T) {
			l := newLiveness()
			s := newStore(t, l)
			fn(t, s, l, newClock(s))
		})
	}
}

const (
	port     = "tcp:20001"
	sshLabel = "localhost:22"
	holdFor  = time.Minute
)

// tcpClaim asks for port, reserved for token, tunnelling sshLabel.
func tcpClaim(token, inst string, session uint64) registry.Claim {
	return registry.Claim{Hostname: port, InstanceID: inst, TokenID: token, SessionID: session,
		Reserve: holdFor, Label: sshLabel}
}

// reservation is what a claim of token for key (with sshLabel and
// holdFor) reserves, until until.
func reservation(key, token string, until time.Time) registry.Reservation {
	return registry.Reservation{Key: key, TokenID: token, Label: sshLabel, For: holdFor, Until: until}
}

// mustFail binds c and wants want, the binding left as it was.
func mustFail(t *testing.T, s registry.Store, c registry.Claim, want error) {
	t.Helper()
	before, held := get(t, s, c.Hostname)
	if res, err := s.Bind(context.Background(), c); !errors.Is(err, want) {
		t.Fatalf("Bind(%+v) = %+v, %v; want %v", c, res, err, want)
	}
	if after, still := get(t, s, c.Hostname); held != still || !reflect.DeepEqual(before, after) {
		t.Fatalf("a refused bind changed the binding from %+v to %+v", before, after)
	}
}

func mustRelease(t *testing.T, s registry.Store, b registry.Binding) {
	t.Helper()
	if ok, err := s.Release(context.Background(), b.Hostname, b.SessionID, b.Generation); !ok || err != nil {
		t.Fatalf("Release(%+v) = %v, %v", b, ok, err)
	}
}

func sameReservation(a, b registry.Reservation) bool {
	return a.Key == b.Key && a.TokenID == b.TokenID && a.Label == b.Label && a.For == b.For && a.Until.Equal(b.Until)
}

// wantReservation checks key's reservation in force: want, or none when
// want is nil.
func wantReservation(t *testing.T, s registry.Reserver, key string, want *registry.Reservation) {
	t.Helper()
	got, ok, err := s.Reservation(context.Background(), key)
	switch {
	case err != nil:
		t.Fatalf("Reservation(%s): %v", key, err)
	case want == nil && ok:
		t.Fatalf("Reservation(%s) = %+v, want none", key, got)
	case want != nil && (!ok || !sameReservation(got, *want)):
		t.Fatalf("Reservation(%s) = %+v, %v; want %+v", key, got, ok, *want)
	}
}

func wantReservedFor(t *testing.T, s registry.Reserver, token, label string, want ...registry.Reservation) {
	t.Helper()
	got, err := s.ReservedFor(context.Background(), token, label)
	if err != nil || !slices.EqualFunc(got, want, sameReservation) {
		t.Fatalf("ReservedFor(%s, %s) = %+v, %v; want %+v", token, label, got, err, want)
	}
}

// TestReserveRefusesOtherToken: a port held by one token is refused to
// another, live holder or dead, and after its release until its For has
// passed; then the other token gets it, and the reservation with it.
func TestReserveRefusesOtherToken(t *testing.T) {
	for _, tc := range []struct {
		name  string
		alive bool
	}{
		{"live holder", true},
		{"dead holder", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forReserveStores(t, func(t *testing.T, s reserveStore, l *liveness, c *clock) {
				a := mustBind(t, s, tcpClaim("tokA", instA, 1), registry.Created).Binding
				l.set(1, tc.alive)
				other := tcpClaim("tokB", instB, 2)
				mustFail(t, s, other, registry.ErrReserved)
				wantReservation(t, s, port, new(reservation(port, "tokA", time.Time{})))

				c.advance(time.Second)
				mustRelease(t, s, a)
				until := epoch.Add(time.Second + holdFor)
				wantReservation(t, s, port, new(reservation(port, "tokA", until)))
				mustFail(t, s, other, registry.ErrReserved)
				c.advance(holdFor - time.Nanosecond)
				mustFail(t, s, other, registry.ErrReserved)

				c.advance(time.Nanosecond) // now == Until: it has ended
				wantReservation(t, s, port, nil)
				mustBind(t, s, other, registry.Created)
				wantReservation(t, s, port, new(reservation(port, "tokB", time.Time{})))
			})
		})
	}
}

// TestReserveSameToken: the token a port is reserved for gets it as the
// binding rules decide, from any of its instances; a granted bind, even
// one that changes nothing, makes the reservation the claim's (held, its
// label).
func TestReserveSameToken(t *testing.T) {
	for _, tc := range []struct {
		name     string
		released bool
		dead     bool
		claim    registry.Claim
		want     registry.Outcome
		wantErr  error
	}{
		{"another instance after release", true, false, tcpClaim("tokA", instB, 2), registry.Created, nil},
		{"another instance, dead holder", false, true, tcpClaim("tokA", instB, 2), registry.DeadHolder, nil},
		{"another instance, live holder", false, false, tcpClaim("tokA", instB, 2), 0, registry.ErrTaken},
		{"the same instance, live holder", false, false, tcpClaim("tokA", instA, 2), registry.SameInstance, nil},
		{"the same session, another label", false, false, relabel(tcpClaim("tokA", instA, 1), "localhost:2222"), registry.Unchanged, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forReserveStores(t, func(t *testing.T, s reserveStore, l *liveness, c *clock) {
				a := mustBind(t, s, tcpClaim("tokA", instA, 1), registry.Created).Binding
				if tc.released {
					mustRelease(t, s, a)
				}
				l.set(1, !tc.dead)
				c.advance(holdFor / 2)
				if tc.wantErr != nil {
					mustFail(t, s, tc.claim, tc.wantErr)
				} else {
					mustBind(t, s, tc.claim, tc.want)
				}
				want := reservation(port, "tokA", time.Time{})
				want.Label = tc.claim.Label
				wantReservation(t, s, port, &want)
			})
		})
	}
}

func relabel(c registry.Claim, label string) registry.Claim {
	c.Label = label
	return c
}

// TestReserveExclusive: an exclusive claim is refused a port reserved for
// another token, held or released, with ErrReserved; the token it is
// reserved for gets it once it is free.
func TestReserveExclusive(t *testing.T) {
	for _, released := range []bool{false, true} {
		name := map[bool]string{false: "held", true: "released"}[released]
		t.Run(name, func(t *testing.T) {
			forReserveStores(t, func(t *testing.T, s reserveStore, l *liveness, c *clock) {
				a := mustBind(t, s, tcpClaim("tokA", instA, 1), registry.Created).Binding
				l.set(1, false)
				if released {
					mustRelease(t, s, a)
				}
				other := tcpClaim("tokB", instB, 2)
				other.Exclusive = true
				mustFail(t, s, other, registry.ErrReserved)
				if released {
					own := tcpClaim("tokA", instB, 3)
					own.Exclusive = true
					mustBind(t, s, own, registry.Created)
				}
			})
		})
	}
}

// TestReserveLostReleaseKeepsReservation: a release that deletes nothing
// (a late cleanup after a takeover, or a wrong generation) leaves the
// reservation held, however long after.
func TestReserveLostReleaseKeepsReservation(t *testing.T) {
	forReserveStores(t, func(t *testing.T, s reserveStore, l *liveness, c *clock) {
		ctx := context.Background()
		old := mustBind(t, s, tcpClaim("tokA", instA, 1), registry.Created).Binding
		cur := mustBind(t, s, tcpClaim("tokA", instA, 2), registry.SameInstance).Binding
		for _, r := range []struct {
			key        string
			session    uint64
			generation uint64
		}{
			{port, old.SessionID, old.Generation},
			{port, cur.SessionID, old.Generation},
			{port, old.SessionID, cur.Generation},
			{"tcp:20002", cur.SessionID, cur.Generation},
		} {
			if ok, err := s.Release(ctx, r.key, r.session, r.generation); ok || err != nil {
				t.Fatalf("Release(%s, %d, %d) = %v, %v; want nothing deleted", r.key, r.session, r.generation, ok, err)
			}
		}
		c.advance(time.Hour)
		wantReservation(t, s, port, new(reservation(port, "tokA", time.Time{})))
		wantReservation(t, s, "tcp:20002", nil)
		mustFail(t, s, tcpClaim("tokB", instB, 3), registry.ErrReserved)
	})
}

// TestReservedFor: a token's reservations in force with one label, held
// or released, sorted by key; not another label's, another token's or an
// expired one.
func TestReservedFor(t *testing.T) {
	forReserveStores(t, func(t *testing.T, s reserveStore, l *liveness, c *clock) {
		bind := func(key, token, label string, reserve time.Duration) registry.Binding {
			cl := tcpClaim(token, instA, 1)
			cl.Hostname, cl.Label, cl.Reserve = key, label, reserve
			return mustBind(t, s, cl, registry.Created).Binding
		}
		for _, key := range []string{"tcp:20009", "tcp:20003", "tcp:20001", "tcp:20005"} {
			bind(key, "tokA", sshLabel, holdFor)
		}
		released := bind("tcp:20007", "tokA", sshLabel, holdFor)
		expired := bind("tcp:20008", "tokA", sshLabel, time.Second)
		bind("tcp:20002", "tokA", "localhost:80", holdFor)
		bind("tcp:20004", "tokB", sshLabel, holdFor)
		mustRelease(t, s, released)
		mustRelease(t, s, expired)
		c.advance(2 * time.Second)

		held := func(key string) registry.Reservation { return reservation(key, "tokA", time.Time{}) }
		wantReservedFor(t, s, "tokA", sshLabel, held("tcp:20001"), held("tcp:20003"), held("tcp:20005"),
			reservation("tcp:20007", "tokA", epoch.Add(holdFor)), held("tcp:20009"))
		wantReservedFor(t, s, "tokB", sshLabel, reservation("tcp:20004", "tokB", time.Time{}))
		wantReservedFor(t, s, "tokA", "nothing")
		wantReservation(t, s, "tcp:20008", nil)
		bind("tcp:20008", "tokB", sshLabel, holdFor) // expired: free for anyone
	})
}

// TestReserveZeroIgnoresReservations: a claim without Reserve (a
// hostname) is never refused for a reservation, nor changes one, and
// makes none.
func TestReserveZeroIgnoresReservations(t *testing.T) {
	for _, tc := range []struct {
		name      string
		released  bool
		exclusive bool
		want      registry.Outcome
	}{
		{"dead holder", false, false, registry.DeadHolder},
		{"released, reserved", true, false, registry.Created},
		{"released, reserved, exclusive", true, true, registry.Created},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forReserveStores(t, func(t *testing.T, s reserveStore, l *liveness, c *clock) {
				a := mustBind(t, s, tcpClaim("tokA", instA, 1), registry.Created).Binding
				mustFail(t, s, registry.Claim{Hostname: port, InstanceID: instB, TokenID: "tokB", SessionID: 2}, registry.ErrTaken)
				l.set(1, false)
				want := reservation(port, "tokA", time.Time{})
				if tc.released {
					mustRelease(t, s, a)
					want.Until = epoch.Add(holdFor)
				}
				cl := registry.Claim{Hostname: port, InstanceID: instB, TokenID: "tokB", SessionID: 3, Exclusive: tc.exclusive, Label: sshLabel}
				mustBind(t, s, cl, tc.want)
				wantReservation(t, s, port, &want)

				cl.Hostname = "tcp:20002"
				mustBind(t, s, cl, registry.Created)
				wantReservation(t, s, cl.Hostname, nil)
			})
		})
	}
}

// TestBoltReservationsSurviveReopen: held and released reservations, with
// their ends, are what the file holds when it is opened again; an expired
// one is gone.
func TestBoltReservationsSurviveReopen(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "registry.db")
	dead := func(registry.Binding) bool { return false } // only reservations refuse
	s, err := registry.OpenBolt(path, dead)
	if err != nil {
		t.Fatal(err)
	}
	c := newClock(s)
	claimOf := func(key string, reserve time.Duration) registry.Claim {
		cl := tcpClaim("tokA", instA, 1)
		cl.Hostname, cl.Reserve = key, reserve
		return cl
	}
	mustBind(t, s, claimOf("tcp:20001", holdFor), registry.Created)
	released := mustBind(t, s, claimOf("tcp:20002", holdFor), registry.Created).Binding
	expired := mustBind(t, s, claimOf("tcp:20003", time.Second), registry.Created).Binding
	mustRelease(t, s, expired)
	c.advance(2 * time.Second)
	mustRelease(t, s, released)
	s.Close()

	s, err = registry.OpenBolt(path, dead)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.SetClock(c.now)
	wantReservation(t, s, "tcp:20001", new(reservation("tcp:20001", "tokA", time.Time{})))
	wantReservation(t, s, "tcp:20002", new(reservation("tcp:20002", "tokA", epoch.Add(2*time.Second+holdFor))))
	wantReservation(t, s, "tcp:20003", nil)
	wantReservedFor(t, s, "tokA", sshLabel, reservation("tcp:20001", "tokA", time.Time{}),
		reservation("tcp:20002", "tokA", epoch.Add(2*time.Second+holdFor)))
	for _, key := range []string{"tcp:20001", "tcp:20002"} {
		other := tcpClaim("tokB", instB, 2)
		other.Hostname = key
		mustFail(t, s, other, registry.ErrReserved)
	}
	other := tcpClaim("tokB", instB, 2)
	other.Hostname = "tcp:20003"
	if _, err := s.Bind(ctx, other); err != nil {
		t.Fatalf("bind of an expired reservation's port: %v", err)
	}
}

// TestBoltOpensFileWithoutReservations: a registry written before
// reservations (no bucket for them) opens with its bindings, and keeps
// the reservations made since across a reopen.
func TestBoltOpensFileWithoutReservations(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "registry.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		meta, _ := tx.CreateBucket([]byte("meta"))
		meta.Put([]byte("format"), []byte("ngstone-registry-v1"))
		meta.Put([]byte("last_generation"), binary.BigEndian.AppendUint64(nil, 1))
		bs, _ := tx.CreateBucket([]byte("bindings"))
		v, _ := json.Marshal(map[string]any{"instance_id": instA, "token_id": "tokA", "session_id": 1, "generation": 1})
		return bs.Put([]byte("app.example.com"), v)
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}

	s := openBolt(t, path)
	if b, ok := get(t, s, "app.example.com"); !ok || b.InstanceID != instA || b.Generation != 1 {
		t.Fatalf("binding of the old file: %+v, %v", b, ok)
	}
	mustBind(t, s, tcpClaim("tokA", instA, 2), registry.Created)
	s.Close()

	s = openBolt(t, path)
	defer s.Close()
	wantReservation(t, s, port, new(reservation(port, "tokA", time.Time{})))
	if _, ok := get(t, s, "app.example.com"); !ok {
		t.Fatal("the old binding is gone")
	}
	if _, err := s.Bind(ctx, tcpClaim("tokB", instB, 3)); !errors.Is(err, registry.ErrReserved) {
		t.Fatalf("another token's bind after reopening: %v, want ErrReserved", err)
	}
}
