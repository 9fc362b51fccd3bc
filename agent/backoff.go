package agent

import (
	"math/rand/v2"
	"time"
)

// backoff is decorrelated jitter: each delay is uniform in [base, 3×previous],
// capped. The first delay after a healthy session is uniform in [0, base),
// so an agent whose network just returned does not wait a whole step, while
// a thousand agents dropped by one edge restart still spread out.
type backoff struct {
	base, cap time.Duration
	prev      time.Duration
}

func (b *backoff) next() time.Duration {
	if b.prev == 0 {
		b.prev = b.base
		return rand.N(b.base)
	}
	hi := min(b.cap, 3*b.prev)
	d := b.base
	if hi > b.base {
		d += rand.N(hi - b.base)
	}
	b.prev = min(d, b.cap)
	return b.prev
}

func (b *backoff) reset() { b.prev = 0 }
