package agent

import (
	"testing"
	"time"
)

// TestBackoff: the first delay is under base; each later one lies in
// [base, min(cap, 3×previous, base + half the time since the first
// failure)]; long outages approach the cap; reset starts over.
func TestBackoff(t *testing.T) {
	const base, cap = 500 * time.Millisecond, 30 * time.Second
	longest := time.Duration(0)
	for run := range 200 {
		b := backoff{base: base, cap: cap}
		now := time.Unix(0, 0)
		start := now
		d := b.next(now)
		if d < 0 || d >= base {
			t.Fatalf("run %d: first delay %v, want [0, %v)", run, d, base)
		}
		prev := base
		for i := range 40 {
			now = now.Add(d)
			d = b.next(now)
			hi := min(cap, 3*prev, base+now.Sub(start)/2)
			if d < base || d > max(hi, base) {
				t.Fatalf("run %d, step %d at %v: delay %v, want [%v, %v]", run, i, now.Sub(start), d, base, hi)
			}
			prev, longest = d, max(longest, d)
		}
		b.reset()
		if d := b.next(now); d >= base {
			t.Fatalf("run %d: first delay after reset %v, want under %v", run, d, base)
		}
	}
	if longest < cap/2 {
		t.Fatalf("the longest of 8,000 delays was %v: they never grew toward the %v cap", longest, cap)
	}
}
