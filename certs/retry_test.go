package certs

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/mholt/acmez/v3/acme"
)

// TestRetryDefaultShape pins the default schedule: minutes, doubling from
// 1m, capped at 1h; and counts the attempts the defaults make during a
// 2-minute outage (the first at its start): 2.
func TestRetryDefaultShape(t *testing.T) {
	b := newRetryBook("", 0, 0, "", testLogger(t))
	want := []time.Duration{time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 16 * time.Minute, 32 * time.Minute, time.Hour, time.Hour}
	for i, w := range want {
		if got := b.delay(i + 1); got != w {
			t.Errorf("delay after %d failures = %v, want %v", i+1, got, w)
		}
	}
	t0 := time.Unix(1_000_000, 0)
	if n := attemptsDuring(b, t0, 2*time.Minute); n != 2 {
		t.Errorf("attempts during a 2m outage with the defaults = %d, want 2", n)
	}
	if n := attemptsDuring(newRetryBook("", 0, 0, "", testLogger(t)), t0, 24*time.Hour); n > 30 {
		t.Errorf("attempts during a day's outage with the defaults = %d, want at most 30", n)
	}
}

// attemptsDuring simulates an outage of length d: each attempt fails at
// once, the next is made as soon as it is due.
func attemptsDuring(b *retryBook, t0 time.Time, d time.Duration) int {
	n := 0
	for now := t0; now.Before(t0.Add(d)); {
		b.begin("x", KindObtain, now)
		b.fail(nil, "x", KindObtain, ErrDNSUnreachable, now)
		n++
		_, now = b.due("x", now)
	}
	return n
}

// TestRetryBookPersists: a restarted book waits out the backoff of the
// failures the last process recorded, an attempt that never finished
// (the process was killed) included; changed settings release the wait.
func TestRetryBookPersists(t *testing.T) {
	path := filepath.Join(t.TempDir(), RetryFile)
	now := time.Now()
	b := newRetryBook(path, time.Minute, time.Hour, "s1", testLogger(t))
	b.begin("*.d.test", KindObtain, now)
	b.fail(nil, "*.d.test", KindObtain, fmt.Errorf("x: %w", ErrDNSAuth), now)
	b.begin("d.test", KindObtain, now) // killed mid-attempt

	again := newRetryBook(path, time.Minute, time.Hour, "s1", testLogger(t))
	again.load(now.Add(time.Second))
	for _, name := range []string{"*.d.test", "d.test"} {
		if due, at := again.due(name, now.Add(time.Second)); due || at.Sub(now) != time.Minute {
			t.Errorf("%s after restart: due=%v next=%v, want not due for a minute", name, due, at.Sub(now))
		}
	}
	if e, _ := again.entry("*.d.test"); e.Reason != ReasonDNSAuth || e.Failures != 1 {
		t.Errorf("entry after restart = %+v", e)
	}
	changed := newRetryBook(path, time.Minute, time.Hour, "s2", testLogger(t))
	changed.load(now.Add(time.Second))
	if due, _ := changed.due("*.d.test", now.Add(time.Second)); !due {
		t.Error("settings changed, but the next attempt is still held back")
	}
	if e, _ := changed.entry("*.d.test"); e.Failures != 1 {
		t.Errorf("failures forgotten on a settings change: %+v", e)
	}
	b.succeed("*.d.test", now)
	b.succeed("d.test", now)
	empty := newRetryBook(path, time.Minute, time.Hour, "s1", testLogger(t))
	empty.load(now)
	if _, ok := empty.entry("*.d.test"); ok {
		t.Error("a success was not persisted")
	}
}

// TestRetryAfterRateLimit: a rate-limit problem holds the next attempt
// until the time the CA named, past the backoff; one that names none
// holds it an hour.
func TestRetryAfterRateLimit(t *testing.T) {
	b := newRetryBook("", time.Minute, time.Hour, "", testLogger(t))
	now := time.Now().UTC()
	later := now.Add(5 * time.Hour).Truncate(time.Second)
	p := acme.Problem{Type: acme.ProblemTypeNamespace + "rateLimited", Status: 429,
		Detail: "too many certificates (5) already issued for this exact set of identifiers in the last 168h0m0s, retry after " + later.Format("2006-01-02 15:04:05") + " UTC: see https://letsencrypt.org/docs/rate-limits/"}
	e := b.fail(nil, "x", KindObtain, fmt.Errorf("obtain: %w", p), now)
	if e.Reason != ReasonRateLimited || !e.NextAttempt.Equal(later) {
		t.Errorf("rate limited: reason %s next %v, want %s %v", e.Reason, e.NextAttempt, ReasonRateLimited, later)
	}
	p.Detail = "slow down"
	if e := b.fail(nil, "y", KindObtain, p, now); e.NextAttempt.Sub(now) < time.Hour {
		t.Errorf("rate limited without a time: next attempt in %v, want at least 1h", e.NextAttempt.Sub(now))
	}
}

func TestFailureReason(t *testing.T) {
	tests := map[string]struct {
		err  error
		want string
	}{
		"dns down":     {fmt.Errorf("a: %w", ErrDNSUnreachable), ReasonDNSUnreachable},
		"tsig":         {fmt.Errorf("a: %w", ErrDNSAuth), ReasonDNSAuth},
		"propagation":  {fmt.Errorf("a: %w", ErrDNSPropagation), ReasonDNSPropagation},
		"ca down":      {fmt.Errorf("a: %w", ErrCAUnreachable), ReasonACMEUnreachable},
		"validation":   {acme.Problem{Type: acme.ProblemTypeNamespace + "unauthorized"}, ReasonValidation},
		"acme":         {acme.Problem{Type: acme.ProblemTypeNamespace + "badCSR"}, ReasonACME},
		"rate limited": {acme.Problem{Status: 429}, ReasonRateLimited},
		"other":        {errors.New("?"), ReasonOther},
	}
	for name, tt := range tests {
		if got, _ := failureReason(tt.err); got != tt.want {
			t.Errorf("%s: %s, want %s", name, got, tt.want)
		}
	}
}

// TestRestartLoopWaits: an edge restarted over and over (a supervisor's
// Restart=on-failure with RestartSec=1s) while issuance fails makes one
// attempt, then waits out the backoff it recorded in the data directory,
// however often it is restarted.
func TestRestartLoopWaits(t *testing.T) {
	t.Parallel()
	p, cfg := rfc2136Config(t)
	cfg.DNSCredentials["tsig_secret"] = "d3Jvbmctc2VjcmV0LXdyb25nLXNlY3JldC13cm9uZyE="
	cfg.OnDemand = true // DOMAIN only: one name
	attempts := 0
	for range 10 {
		m, err := New(cfg, testLogger(t), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		if attempts == 0 {
			waitStatus(t, m, ReasonDNSAuth)
		} else {
			time.Sleep(20 * time.Millisecond) // as long as a restart takes
		}
		for _, c := range m.Stats().Attempts {
			attempts += int(c.N)
		}
		m.Close()
	}
	t.Logf("10 starts with a refused key: %d attempt(s), %d orders", attempts, p.Orders())
	// This DNS server answers queries whatever their signature (BIND does
	// not: TestBINDErrorsNameTheCause), so the one attempt gets as far as
	// an order.
	if attempts != 1 || p.Orders() > 1 {
		t.Errorf("10 starts made %d attempts and %d orders; want 1 attempt, then the backoff", attempts, p.Orders())
	}
}
