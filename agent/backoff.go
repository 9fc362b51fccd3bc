package agent

import (
	"math/rand/v2"
	"time"
)

// backoff is decorrelated jitter: each delay is uniform in [base, 3×previous],
// capped. The first delay after a healthy session is uniform in [0, base),
// so an agent whose network just returned does not wait a whole step, while
// a thousand agents dropped by one edge restart still spread out.
//
// A delay is also held to base plus half the time since the first failure,
// so the wait once the edge is back is at most about half as long as the
// outage was: decorrelated jitter alone may draw 3×previous after a few
// seconds' outage and keep an agent away for seconds after its network
// (or the edge) returned.
type backoff struct {
	base, cap time.Duration
	prev      time.Duration
	since     time.Time // the first failure of this run
}

func (b *backoff) next(now time.Time) time.Duration {
	if b.prev == 0 {
		b.prev, b.since = b.base, now
		return rand.N(b.base)
	}
	hi := min(b.cap, 3*b.prev, b.base+now.Sub(b.since)/2)
	d := b.base
	if hi > b.base {
		d += rand.N(hi - b.base)
	}
	b.prev = min(d, b.cap)
	return b.prev
}

func (b *backoff) reset() { b.prev = 0 }
