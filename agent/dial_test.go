package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

// silentDials returns a dial func whose first silent calls wait, as a SYN
// into a black hole does, until their context ends; later calls connect.
// It counts the calls and the silent calls that have returned.
func silentDials(silent int64, calls, ended *atomic.Int64, conns chan<- net.Conn) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		if calls.Add(1) <= silent {
			<-ctx.Done()
			ended.Add(1)
			return nil, ctx.Err()
		}
		c, peer := net.Pipe()
		conns <- peer
		return c, nil
	}
}

// TestDialStaggeredTakesAFreshDial: while earlier dials wait on a silent
// network, a fresh one starts every interval; the first to connect is
// taken at once, and the waiting ones are cancelled before it returns.
func TestDialStaggeredTakesAFreshDial(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls, ended atomic.Int64
		conns := make(chan net.Conn, 8)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		start := time.Now()
		c, err := dialStaggered(ctx, 500*time.Millisecond, 20, silentDials(5, &calls, &ended, conns))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if d := time.Since(start); d != 5*500*time.Millisecond {
			t.Errorf("connected after %v, want the sixth dial's start, 2.5s", d)
		}
		if calls.Load() != 6 || ended.Load() != 5 {
			t.Errorf("%d dials, %d of the 5 silent ones ended, before it returned", calls.Load(), ended.Load())
		}
		(<-conns).Close()
	})
}

// TestDialStaggeredSilent: with no answer at all, at most the bound of
// dials start, and the error says the network was silent.
func TestDialStaggeredSilent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls, ended atomic.Int64
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := dialStaggered(ctx, 500*time.Millisecond, 4, silentDials(100, &calls, &ended, nil))
		if !errors.Is(err, errNoAnswer) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want errNoAnswer and the deadline", err)
		}
		if calls.Load() != 4 || ended.Load() != 4 {
			t.Errorf("%d dials started, %d ended; want 4 and 4", calls.Load(), ended.Load())
		}
	})
}

// TestDialStaggeredRefused: a dial that fails fast ends the connect with
// its error (the backoff then applies), and the waiting ones are
// cancelled; a dial that connects after another won is closed.
func TestDialStaggeredRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls atomic.Int64
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := dialStaggered(ctx, 500*time.Millisecond, 20, func(ctx context.Context) (net.Conn, error) {
			if calls.Add(1) == 1 {
				<-ctx.Done()
				return nil, ctx.Err()
			}
			return nil, syscall.ECONNREFUSED
		})
		if !errors.Is(err, syscall.ECONNREFUSED) || calls.Load() != 2 {
			t.Fatalf("err = %v after %d dials, want the refusal of the second", err, calls.Load())
		}

		late := make(chan net.Conn, 1)
		c, err := dialStaggered(ctx, 500*time.Millisecond, 20, func(ctx context.Context) (net.Conn, error) {
			a, b := net.Pipe()
			if calls.Add(1) == 3 {
				time.Sleep(time.Second) // connects after the second dial has won
				late <- b
				return a, nil
			}
			go b.Close()
			return a, nil
		})
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		peer := <-late
		if _, err := peer.Read(make([]byte, 1)); err == nil {
			t.Error("the dial that connected late was left open")
		}
	})
}

// TestRetryDelaySilent: after a connect no dial got an answer to, the next
// starts at once; after any other failure the backoff applies.
func TestRetryDelaySilent(t *testing.T) {
	bo := backoff{base: time.Second, cap: 30 * time.Second}
	bo.next(time.Now()) // past the first, shorter delay
	silent := fmt.Errorf("dial edge: %w", fmt.Errorf("%w: %w", errNoAnswer, context.DeadlineExceeded))
	if d := retryDelay(&bo, silent); d != 0 {
		t.Errorf("after a silent network: %v, want 0", d)
	}
	if d := retryDelay(&bo, syscall.ECONNREFUSED); d < time.Second {
		t.Errorf("after a refusal: %v, want the backoff of at least its 1s base", d)
	}
}
