package mux

import (
	"context"
	"sync"
)

// Tracker counts a session's streams in flight so that a drain can wait for
// them to end. The zero value is ready to use.
type Tracker struct {
	mu      sync.Mutex
	n       int
	waiters []chan struct{}
}

// Add records a stream starting.
func (t *Tracker) Add() {
	t.mu.Lock()
	t.n++
	t.mu.Unlock()
}

// TryAdd records a stream starting unless limit streams are in flight
// already (a limit of zero or less means none).
func (t *Tracker) TryAdd(limit int) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if limit > 0 && t.n >= limit {
		return false
	}
	t.n++
	return true
}

// Done records a stream ending.
func (t *Tracker) Done() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.n--
	if t.n == 0 {
		for _, w := range t.waiters {
			close(w)
		}
		t.waiters = nil
	}
}

// Count returns the streams in flight.
func (t *Tracker) Count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.n
}

// Wait returns when no stream is in flight, ctx ends or stop closes.
func (t *Tracker) Wait(ctx context.Context, stop <-chan struct{}) {
	t.mu.Lock()
	if t.n == 0 {
		t.mu.Unlock()
		return
	}
	ch := make(chan struct{})
	t.waiters = append(t.waiters, ch)
	t.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
	case <-stop:
	}
}

// BufferPool recycles 32 KiB copy buffers; it satisfies
// httputil.BufferPool. The pool holds array pointers, which a slice of the
// whole array converts back to without an allocation (a *[]byte put back
// would be one per exchange).
type BufferPool struct{}

const copyBufSize = 32 << 10

var copyBufs = sync.Pool{New: func() any { return new([copyBufSize]byte) }}

// Get returns a buffer.
func (BufferPool) Get() []byte { return copyBufs.Get().(*[copyBufSize]byte)[:] }

// Put returns a buffer to the pool; one of another size is left to the
// collector.
func (BufferPool) Put(b []byte) {
	if cap(b) == copyBufSize {
		copyBufs.Put((*[copyBufSize]byte)(b[:copyBufSize]))
	}
}
