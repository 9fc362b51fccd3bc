package mux

import (
	"context"
	"sync"
	"testing"
	"time"
)

// waitReturns runs Wait in a goroutine and reports on the returned channel
// when it returns.
func waitReturns(tr *Tracker, ctx context.Context, stop <-chan struct{}) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		tr.Wait(ctx, stop)
	}()
	return done
}

func mustReturn(t *testing.T, done <-chan struct{}, why string) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("Wait did not return %s", why)
	}
}

// mustBlock checks that Wait has not returned. Only a positive answer is
// meaningful here; the bounded look keeps the test fast.
func mustBlock(t *testing.T, done <-chan struct{}, why string) {
	t.Helper()
	select {
	case <-done:
		t.Fatalf("Wait returned %s", why)
	case <-time.After(20 * time.Millisecond):
	}
}

func TestTrackerZeroValueWaitReturnsAtOnce(t *testing.T) {
	var tr Tracker
	mustReturn(t, waitReturns(&tr, context.Background(), nil), "with nothing in flight")
	if tr.Count() != 0 {
		t.Fatalf("Count = %d", tr.Count())
	}
}

func TestTrackerWaitReturnsAtZero(t *testing.T) {
	var tr Tracker
	tr.Add()
	tr.Add()
	done := waitReturns(&tr, context.Background(), nil)
	second := waitReturns(&tr, context.Background(), nil)
	tr.Done()
	if tr.Count() != 1 {
		t.Fatalf("Count = %d, want 1", tr.Count())
	}
	mustBlock(t, done, "with one stream still in flight")
	tr.Done()
	mustReturn(t, done, "when the count reached zero")
	mustReturn(t, second, "for a second waiter when the count reached zero")
	// The tracker is reusable after reaching zero.
	tr.Add()
	again := waitReturns(&tr, context.Background(), nil)
	mustBlock(t, again, "on a reused tracker with one in flight")
	tr.Done()
	mustReturn(t, again, "on a reused tracker at zero")
}

func TestTrackerWaitReturnsOnContextEnd(t *testing.T) {
	var tr Tracker
	tr.Add()
	t.Cleanup(tr.Done)
	ctx, cancel := context.WithCancel(context.Background())
	done := waitReturns(&tr, ctx, nil)
	mustBlock(t, done, "before ctx ended")
	cancel()
	mustReturn(t, done, "when ctx ended")
	if tr.Count() != 1 {
		t.Fatalf("Count = %d, want 1", tr.Count())
	}
}

func TestTrackerWaitReturnsOnStop(t *testing.T) {
	var tr Tracker
	tr.Add()
	t.Cleanup(tr.Done)
	stop := make(chan struct{})
	done := waitReturns(&tr, context.Background(), stop)
	mustBlock(t, done, "before stop closed")
	close(stop)
	mustReturn(t, done, "when stop closed")
}

func TestTrackerConcurrent(t *testing.T) {
	var tr Tracker
	const n = 64
	for range n {
		tr.Add()
	}
	done := waitReturns(&tr, context.Background(), nil)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() { defer wg.Done(); tr.Done() }()
	}
	wg.Wait()
	mustReturn(t, done, "after concurrent Done calls")
	if tr.Count() != 0 {
		t.Fatalf("Count = %d, want 0", tr.Count())
	}
}

func TestBufferPool(t *testing.T) {
	var p BufferPool
	b := p.Get()
	if len(b) != 32<<10 {
		t.Fatalf("buffer of %d bytes, want 32 KiB", len(b))
	}
	p.Put(b)
	if len(p.Get()) != 32<<10 {
		t.Fatal("recycled buffer has the wrong size")
	}
}
