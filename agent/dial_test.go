package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
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

// TestStaggeredTakesAFreshAttempt: while earlier attempts wait on a silent
// network, a fresh one starts every interval; the first to connect is
// taken at once, and the waiting ones are cancelled before it returns.
func TestStaggeredTakesAFreshAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls, ended atomic.Int64
		conns := make(chan net.Conn, 8)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		start := time.Now()
		c, err := staggered(ctx, pace{every: 500 * time.Millisecond, life: time.Hour, most: 20}, silentDials(5, &calls, &ended, conns))
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

// TestStaggeredSilent: with no answer at all, at most the bound of
// attempts wait at once, and the error says the network was silent.
func TestStaggeredSilent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls, ended atomic.Int64
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := staggered(ctx, pace{every: 500 * time.Millisecond, life: time.Hour, most: 4}, silentDials(100, &calls, &ended, nil))
		if !errors.Is(err, errNoAnswer) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want errNoAnswer and the deadline", err)
		}
		if calls.Load() != 4 || ended.Load() != 4 {
			t.Errorf("%d dials started, %d ended; want 4 and 4", calls.Load(), ended.Load())
		}
	})
}

// TestStaggeredRefused: an attempt that fails fast ends the connect with
// its error (the backoff then applies), and the waiting ones are
// cancelled; an attempt that connects after another won is closed.
func TestStaggeredRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls atomic.Int64
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := staggered(ctx, pace{every: 500 * time.Millisecond, life: time.Hour, most: 20}, func(ctx context.Context) (net.Conn, error) {
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
		c, err := staggered(ctx, pace{every: 500 * time.Millisecond, life: time.Hour, most: 20}, func(ctx context.Context) (net.Conn, error) {
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

// TestStaggeredFreshSYNs: into a silent network, a fresh attempt starts
// every p.every and each but the first is cancelled after p.life, before
// the kernel would send its SYN again; an expired attempt does not end the
// connect, the first waits until its deadline, and no more than
// life/every+2 wait at once.
func TestStaggeredFreshSYNs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := pace{every: 50 * time.Millisecond, life: 900 * time.Millisecond, most: 20}
		var mu sync.Mutex
		var lives []time.Duration
		waiting, most := 0, 0
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		start := time.Now()
		_, err := staggered(ctx, p, func(ctx context.Context) (net.Conn, error) {
			mu.Lock()
			waiting++
			most = max(most, waiting)
			mu.Unlock()
			t0 := time.Now()
			<-ctx.Done()
			mu.Lock()
			waiting--
			lives = append(lives, time.Since(t0))
			mu.Unlock()
			return nil, ctx.Err()
		})
		if !errors.Is(err, errNoAnswer) || time.Since(start) != 5*time.Second {
			t.Fatalf("err = %v after %v, want errNoAnswer at the 5s deadline", err, time.Since(start))
		}
		mu.Lock()
		defer mu.Unlock()
		// Dials at 0, 50ms, … 4.95s (the tick at 5s meets the deadline).
		if n := len(lives); n < 100 || n > 101 {
			t.Errorf("%d dials in 5s, want one per 50ms", n)
		}
		// The first, those of the last life, and one ending as another starts.
		if want := int(p.life/p.every) + 2; most > want {
			t.Errorf("%d dials waited at once, want at most %d", most, want)
		}
		full, first := 0, 0
		for _, d := range lives {
			switch {
			case d == p.life:
				full++
			case d == 5*time.Second:
				first++
			case d > p.life:
				t.Errorf("a dial waited %v, more than its life %v", d, p.life)
			}
		}
		if first != 1 || full < 80 {
			t.Errorf("%d dials waited the whole connect (want the first alone), %d their whole life", first, full)
		}
	})
}

// TestPaceFor: a fresh attempt starts every few measured round trips,
// within its bounds, and a second before any was measured.
func TestPaceFor(t *testing.T) {
	for _, tc := range []struct {
		rtt, every, life time.Duration
	}{
		{0, time.Second, 900 * time.Millisecond},
		{time.Millisecond, 250 * time.Millisecond, 900 * time.Millisecond},
		{80 * time.Millisecond, 320 * time.Millisecond, 900 * time.Millisecond},
		{time.Second, time.Second, 4 * time.Second},
	} {
		if p := paceFor(tc.rtt); p.every != tc.every || p.life != tc.life || p.most != 5 {
			t.Errorf("paceFor(%v) = %+v, want every %v, life %v, most 5", tc.rtt, p, tc.every, tc.life)
		}
	}
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

// sameTwoPorts listens on 127.0.0.1 and 127.0.0.2 at one port, as two edges
// behind one name are; the first accepts and never answers, the second
// greets each connection.
func sameTwoPorts(t *testing.T) (port string) {
	t.Helper()
	for range 20 {
		silent, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ = net.SplitHostPort(silent.Addr().String())
		live, err := net.Listen("tcp", "127.0.0.2:"+port)
		if err != nil {
			silent.Close()
			continue
		}
		var wg sync.WaitGroup
		t.Cleanup(func() { silent.Close(); live.Close(); wg.Wait() })
		wg.Go(func() {
			var held []net.Conn // accepted, never answered, closed at the end
			defer func() {
				for _, c := range held {
					c.Close()
				}
			}()
			for {
				c, err := silent.Accept()
				if err != nil {
					return
				}
				held = append(held, c)
			}
		})
		wg.Go(func() {
			for {
				c, err := live.Accept()
				if err != nil {
					return
				}
				c.Write([]byte("edge\n"))
				c.Close()
			}
		})
		return port
	}
	t.Skip("no port free on both 127.0.0.1 and 127.0.0.2")
	return ""
}

// TestDialEdgeRotates: the n-th attempt dials a name's addresses from its
// n-th on, and goes on to the next one that refuses; an address is dialed
// as it is.
func TestDialEdgeRotates(t *testing.T) {
	port := sameTwoPorts(t)
	both := func(context.Context, string) ([]string, error) { return []string{"127.0.0.1", "127.0.0.2"}, nil }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for n, want := range []string{"127.0.0.1", "127.0.0.2", "127.0.0.1"} {
		c, err := dialEdge(ctx, "edges.test:"+port, n, both)
		if err != nil {
			t.Fatalf("attempt %d: %v", n, err)
		}
		if got, _, _ := net.SplitHostPort(c.RemoteAddr().String()); got != want {
			t.Errorf("attempt %d dialed %s, want %s", n, got, want)
		}
		c.Close()
	}
	// 127.0.0.3 refuses: the attempt that starts there goes on.
	refusing := func(context.Context, string) ([]string, error) { return []string{"127.0.0.3", "127.0.0.2"}, nil }
	c, err := dialEdge(ctx, "edges.test:"+port, 0, refusing)
	if err != nil {
		t.Fatalf("past a refusing address: %v", err)
	}
	c.Close()
	if _, err := dialEdge(ctx, "edges.test:"+port, 0, func(context.Context, string) ([]string, error) { return []string{"127.0.0.3"}, nil }); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("only a refusing address: %v, want connection refused", err)
	}
	c, err = dialEdge(ctx, "127.0.0.2:"+port, 5, nil) // an address: no lookup
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}

// TestStaggeredPastASilentEdge: of two edges behind one name, the first
// accepts connections and never answers (a stopped process); a connect
// whose attempts each wait for the edge's first bytes reaches the second
// one attempt later, not at its deadline.
func TestStaggeredPastASilentEdge(t *testing.T) {
	port := sameTwoPorts(t)
	both := func(context.Context, string) ([]string, error) { return []string{"127.0.0.1", "127.0.0.2"}, nil }
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var n atomic.Int64
	start := time.Now()
	c, err := staggered(ctx, pace{every: 100 * time.Millisecond, life: 15 * time.Second, most: 5}, func(ctx context.Context) (net.Conn, error) {
		c, err := dialEdge(ctx, "edges.test:"+port, int(n.Add(1)-1), both)
		if err != nil {
			return nil, err
		}
		stop := context.AfterFunc(ctx, func() { c.Close() })
		defer stop()
		if _, err := c.Read(make([]byte, 5)); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	})
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer c.Close()
	if got, _, _ := net.SplitHostPort(c.RemoteAddr().String()); got != "127.0.0.2" || n.Load() < 2 {
		t.Errorf("connected to %s after %d attempts, want 127.0.0.2 on the second or later", got, n.Load())
	}
	t.Logf("through the second edge after %v", time.Since(start).Round(time.Millisecond))
}
