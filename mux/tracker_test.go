package mux

import (
	"context"
	"runtime/debug"
	"sync"
	"testing"
	"testing/synctest"
)

// waiter runs Tracker.Wait in a goroutine of the synctest bubble; returned
// reports, once every goroutine of the bubble is blocked, whether it has
// returned.
type waiter struct{ done chan struct{} }

func startWait(tr *Tracker, ctx context.Context, stop <-chan struct{}) *waiter {
	w := &waiter{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		tr.Wait(ctx, stop)
	}()
	return w
}

func (w *waiter) returned() bool {
	synctest.Wait()
	select {
	case <-w.done:
		return true
	default:
		return false
	}
}

func TestTrackerZeroValueWaitReturnsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var tr Tracker
		if !startWait(&tr, context.Background(), nil).returned() {
			t.Fatal("Wait blocked with nothing in flight")
		}
		if tr.Count() != 0 {
			t.Fatalf("Count = %d", tr.Count())
		}
	})
}

func TestTrackerWaitReturnsAtZero(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var tr Tracker
		tr.Add()
		tr.Add()
		first := startWait(&tr, context.Background(), nil)
		second := startWait(&tr, context.Background(), nil)
		tr.Done()
		if tr.Count() != 1 {
			t.Fatalf("Count = %d, want 1", tr.Count())
		}
		if first.returned() || second.returned() {
			t.Fatal("Wait returned with one stream still in flight")
		}
		tr.Done()
		if !first.returned() || !second.returned() {
			t.Fatal("Wait did not return when the count reached zero")
		}
		// The tracker is reusable after reaching zero.
		tr.Add()
		again := startWait(&tr, context.Background(), nil)
		if again.returned() {
			t.Fatal("Wait on a reused tracker returned with one in flight")
		}
		tr.Done()
		if !again.returned() {
			t.Fatal("Wait on a reused tracker did not return at zero")
		}
	})
}

func TestTrackerWaitReturnsOnContextEnd(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var tr Tracker
		tr.Add()
		ctx, cancel := context.WithCancel(context.Background())
		w := startWait(&tr, ctx, nil)
		if w.returned() {
			t.Fatal("Wait returned before ctx ended")
		}
		cancel()
		if !w.returned() {
			t.Fatal("Wait did not return when ctx ended")
		}
		if tr.Count() != 1 {
			t.Fatalf("Count = %d, want 1", tr.Count())
		}
	})
}

func TestTrackerWaitReturnsOnStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var tr Tracker
		tr.Add()
		stop := make(chan struct{})
		w := startWait(&tr, context.Background(), stop)
		if w.returned() {
			t.Fatal("Wait returned before stop closed")
		}
		close(stop)
		if !w.returned() {
			t.Fatal("Wait did not return when stop closed")
		}
	})
}

func TestTrackerConcurrent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var tr Tracker
		const n = 64
		for range n {
			tr.Add()
		}
		w := startWait(&tr, context.Background(), nil)
		var wg sync.WaitGroup
		for range n {
			wg.Go(tr.Done)
		}
		wg.Wait()
		if !w.returned() || tr.Count() != 0 {
			t.Fatalf("after %d concurrent Done calls: returned %v, Count %d", n, w.returned(), tr.Count())
		}
	})
}

// TestBufferPool: Get always returns a 32 KiB buffer, whatever was put
// back: a buffer re-sliced shorter comes back whole, and one of another
// capacity is not kept. The pool is drained first, so what Get returns
// after a Put is what was put.
func TestBufferPool(t *testing.T) {
	var p BufferPool
	defer debug.SetGCPercent(debug.SetGCPercent(-1)) // the pool keeps what is put until a collection
	// A buffer of Get's, put back resliced short, comes back whole.
	short := p.Get()[:10]
	short[0] = 'x'
	p.Put(short)
	// Buffers of other sizes (a caller's own) are not pooled: a short one
	// would not convert, a larger one would pin its array.
	p.Put(make([]byte, 10))
	big := make([]byte, 32<<10, 64<<10)
	p.Put(big[:100])
	var sawShort bool
	for range 64 {
		b := p.Get()
		if len(b) != 32<<10 || cap(b) != 32<<10 {
			t.Fatalf("buffer of %d bytes (capacity %d), want 32 KiB", len(b), cap(b))
		}
		if &b[0] == &big[0] {
			t.Fatal("Get returned a buffer of another capacity that was put back")
		}
		sawShort = sawShort || &b[0] == &short[0]
	}
	if !sawShort && !raceEnabled {
		t.Error("a buffer of Get's, put back resliced, was not pooled")
	}
}
