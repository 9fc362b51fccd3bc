package registry

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
)

// TestEtcdBindStaleReservation: a bind decided on reads from before the
// port was bound and released again by another token finds the binding
// absent, as read, but the port now reserved: the compare on the
// reservation must stop its transaction, and the next attempt is refused.
func TestEtcdBindStaleReservation(t *testing.T) {
	ctx := context.Background()
	s := NewEtcd(EtcdConfig{Endpoints: etcdtest.Endpoints(t), Prefix: etcdtest.Prefix(t), Node: "a", LeaseTTL: 6 * time.Second})
	if err := s.Start(ctx, "a:7443", Hooks{}); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const key = "tcp:20001"
	claimOf := func(token string, session uint64) Claim {
		return Claim{Hostname: key, InstanceID: token, TokenID: token, SessionID: session, Node: "a", Reserve: time.Minute}
	}
	stale, err := s.readReservation(ctx, key)
	if err != nil || stale.rev != 0 {
		t.Fatalf("reservation of a port never bound: %+v, %v", stale, err)
	}

	res, err := s.Bind(ctx, claimOf("tokA", 1))
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Release(ctx, key, 1, res.Binding.Generation); !ok || err != nil {
		t.Fatalf("release: %v, %v", ok, err)
	}

	lease, _ := s.currentLease()
	if res, done, err := s.tryBind(ctx, claimOf("tokB", 2), lease, s.hostKey(key), held{}, stale); done || err != nil {
		t.Fatalf("a bind on a stale read of the reservation committed: %+v, done %v, %v", res, done, err)
	}
	if res, err := s.Bind(ctx, claimOf("tokB", 2)); !errors.Is(err, ErrReserved) {
		t.Fatalf("tokB's bind of a port reserved for tokA: %+v, %v; want ErrReserved", res, err)
	}
}
