package registry_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/registry"
)

// twoEdges starts edges a and b on one etcd prefix, their reservations
// on one clock.
func twoEdges(t *testing.T) (a, b *registry.Etcd, c *clock, prefix string) {
	cli, prefix := etcdtest.Endpoints(t), etcdtest.Prefix(t)
	a = startNode(t, cli, prefix, "a", registry.Hooks{})
	b = startNode(t, cli, prefix, "b", registry.Hooks{})
	c = newClock(a)
	b.SetClock(c.now)
	return a, b, c, prefix
}

// on is c as claimed on edge s.
func on(s *registry.Etcd, c registry.Claim) registry.Claim {
	c.Node = s.Node()
	return c
}

// TestEtcdReserveAcrossEdges: a port that token A held through edge a,
// and released there, is refused to token B on edge b until its For has
// passed, by the Until a started; then B gets it, and the reservation
// becomes B's on every edge. The watch keeps reservations out of b's
// route cache.
func TestEtcdReserveAcrossEdges(t *testing.T) {
	a, b, c, _ := twoEdges(t)
	held, err := openBind(t, a, tcpClaim("tokA", instA, 1))
	if err != nil {
		t.Fatal(err)
	}
	other := on(b, tcpClaim("tokB", instB, 2))
	mustFail(t, b, other, registry.ErrReserved)
	wantReservation(t, b, port, new(reservation(port, "tokA", time.Time{})))

	c.advance(time.Second)
	mustRelease(t, a, held.Binding)
	until := epoch.Add(time.Second + holdFor) // from the release, not from when b looks
	c.advance(time.Second)
	wantReservation(t, b, port, new(reservation(port, "tokA", until)))
	wantReservedFor(t, b, "tokA", sshLabel, reservation(port, "tokA", until))
	mustFail(t, b, other, registry.ErrReserved)

	// Once b's watch has delivered a binding made after the release (and
	// after the reservation's write), its cache holds no route for port.
	sentinel, err := openBind(t, a, claim(instA, 9))
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "b's cache to learn the sentinel", func() bool { r, ok := b.Lookup(host); return ok && reflect.DeepEqual(r, sentinel.Binding) })
	if r, ok := b.Lookup(port); ok {
		t.Fatalf("b's route cache holds %+v for %s, bound nowhere", r, port)
	}

	c.advance(until.Sub(c.now()) - time.Nanosecond)
	mustFail(t, b, other, registry.ErrReserved)
	c.advance(time.Nanosecond)
	if res, err := openBind(t, b, other); err != nil || res.Outcome != registry.Created {
		t.Fatalf("B's bind on b once A's reservation ended: %+v, %v", res, err)
	}
	wantReservation(t, a, port, new(reservation(port, "tokB", time.Time{})))
	wantReservedFor(t, a, "tokA", sshLabel)
}

// TestEtcdReserveAfterLeaseExpiry: edge a, holding a port for token A,
// goes away without releasing it (its lease revoked, as one that expires):
// the binding goes with the lease, the reservation stays, held. The first
// edge to find it so starts its clock then, not at the bind: B is refused
// for For from that instant, on every edge, and admitted after.
func TestEtcdReserveAfterLeaseExpiry(t *testing.T) {
	a, b, c, prefix := twoEdges(t)
	if _, err := openBind(t, a, tcpClaim("tokA", instA, 1)); err != nil {
		t.Fatal(err)
	}
	a.Close()
	if bd, ok := get(t, b, port); ok {
		t.Fatalf("a's binding %+v outlived its lease", bd)
	}
	admin := etcdtest.Client(t)
	stored := func() string {
		resp, err := admin.Get(context.Background(), prefix+"reserved/"+port)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("reservation in etcd: %v, %v", resp, err)
		}
		return string(resp.Kvs[0].Value)
	}
	if v := stored(); strings.Contains(v, "until") {
		t.Fatalf("the reservation was started by nobody's release: %s", v)
	}

	c.advance(time.Hour) // longer than For: the clock starts when found
	found := c.now()
	other := on(b, tcpClaim("tokB", instB, 2))
	mustFail(t, b, other, registry.ErrReserved)
	until := found.Add(holdFor)
	wantReservation(t, b, port, new(reservation(port, "tokA", until)))
	if v := stored(); !strings.Contains(v, "until") {
		t.Fatalf("the clock b started is not in etcd, for the other edges: %s", v)
	}

	c.advance(holdFor - time.Nanosecond)
	mustFail(t, b, other, registry.ErrReserved)
	c.advance(time.Nanosecond)
	if res, err := openBind(t, b, other); err != nil || res.Outcome != registry.Created {
		t.Fatalf("B's bind once A's reservation ended: %+v, %v", res, err)
	}
}

// TestEtcdProtoAcrossEdges: a TLS passthrough binding made on edge a is
// one on edge b, by Get, List, Route and the watch's cache; a binding
// stored before Proto was (no field) reads as HTTP.
func TestEtcdProtoAcrossEdges(t *testing.T) {
	a, b, _, prefix := twoEdges(t)
	ctx := context.Background()
	c := claim(instA, 1)
	c.Hostname, c.Proto = "pt.example.com", "tls"
	res, err := openBind(t, a, c)
	if err != nil || res.Binding.Proto != "tls" {
		t.Fatalf("bind with proto tls: %+v, %v", res, err)
	}
	want := res.Binding
	mustOwn(t, b, want)
	if got, ok, err := b.Route(ctx, c.Hostname); err != nil || !ok || !reflect.DeepEqual(got, want) {
		t.Fatalf("b's Route = %+v, %v, %v; want %+v", got, ok, err, want)
	}
	eventually(t, "b's cache to learn the binding", func() bool { r, ok := b.Lookup(c.Hostname); return ok && reflect.DeepEqual(r, want) })

	old := `{"instance_id":"` + instB + `","token_id":"tok","session_id":3,"node":"a","bound_at":"2025-01-01T00:00:00Z"}`
	if _, err := etcdtest.Client(t).Put(ctx, prefix+"hosts/old.example.com", old); err != nil {
		t.Fatal(err)
	}
	list, err := b.List(ctx)
	if err != nil || len(list) != 2 || list[0].Hostname != "old.example.com" || list[0].Proto != "" || !reflect.DeepEqual(list[1], want) {
		t.Fatalf("b's List = %+v, %v; want the old binding, HTTP, then %+v", list, err, want)
	}
}

// TestEtcdReserveRace: in each round, token A on edge a and token B on
// edge b bind one free port at once: exactly one wins, the other is
// refused, and the port and its reservation are the winner's.
func TestEtcdReserveRace(t *testing.T) {
	a, b, _, _ := twoEdges(t)
	ctx := context.Background()
	wins := map[string]int{}
	for round := range 20 {
		key := fmt.Sprintf("tcp:%d", 21000+round)
		claims := []registry.Claim{on(a, tcpClaim("tokA", instA, uint64(2*round+1))), on(b, tcpClaim("tokB", instB, uint64(2*round+2)))}
		stores := []*registry.Etcd{a, b}
		results := make([]registry.Result, 2)
		errs := make([]error, 2)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, s := range stores {
			claims[i].Hostname = key
			if err := s.OpenSession(ctx, registry.Session{ID: claims[i].SessionID}); err != nil {
				t.Fatal(err)
			}
			wg.Go(func() {
				<-start
				results[i], errs[i] = s.Bind(ctx, claims[i])
			})
		}
		close(start)
		wg.Wait()
		won := -1
		for i, err := range errs {
			switch {
			case err == nil && won >= 0:
				t.Fatalf("round %d: both tokens won %s: %+v and %+v", round, key, results[won], results[i])
			case err == nil:
				won = i
			case !errors.Is(err, registry.ErrReserved) && !errors.Is(err, registry.ErrTaken):
				t.Fatalf("round %d: %s's bind: %v", round, claims[i].TokenID, err)
			}
		}
		if won < 0 {
			t.Fatalf("round %d: neither token won %s: %v", round, key, errs)
		}
		mustOwn(t, a, results[won].Binding)
		wantReservation(t, b, key, new(reservation(key, claims[won].TokenID, time.Time{})))
		wins[claims[won].TokenID]++
	}
	t.Logf("wins by token: %v", wins)
}
