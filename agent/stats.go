package agent

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// The console's and the local API's counters, as ngrok's show them: each
// exchange the edge opens a stream for is one connection. The quantiles
// are exact, of the durations of the connections that ended in the last
// five minutes (the last durKeep of them at most).

const (
	// rateWindow is the longest rate the counters give (5 minutes), in
	// one-second buckets.
	rateWindow = 300
	// recentKeep is how many ended requests the console can show.
	recentKeep = 64
	// durKeep bounds the durations the quantiles are taken over.
	durKeep = 4096
)

// Request is one exchange as the console lists it.
type Request struct {
	Start    time.Time
	Method   string
	Path     string
	Status   int    // 0: none, the exchange broke
	Code     string // the agent's own error code when it answered itself
	Duration time.Duration
	Replay   bool   // sent by the inspector, not through the tunnel
	Tunnel   string // the tunnel's name, when the agent has several
}

// Stats is a snapshot of the agent's connections.
type Stats struct {
	Total int64 // connections ended or open since the agent started
	Open  int64 // in flight now (an upgraded one until it closes)
	// Rate1 and Rate5 are connections a second over the last 1 and 5
	// minutes.
	Rate1, Rate5 float64
	// P50 and P90 are connection durations over the last 5 minutes; -1
	// when none ended in that time.
	P50, P90 time.Duration
	Recent   []Request // newest first
}

type bucket struct {
	sec int64 // the unix second it counts
	n   int64
}

// stats counts connections. Its zero value is not ready: newStats.
type stats struct {
	open atomic.Int64

	mu      sync.Mutex
	total   int64
	buckets [rateWindow]bucket
	recent  ring[Request]
	durs    ring[ended]
}

// ring keeps the last size values added, the oldest overwritten first.
type ring[T any] struct {
	v      []T
	oldest int // where the next value goes once v is full
	size   int
}

func (r *ring[T]) add(x T) {
	if len(r.v) < r.size {
		r.v = append(r.v, x)
		return
	}
	r.v[r.oldest] = x
	r.oldest = (r.oldest + 1) % r.size
}

// newestFirst returns the values kept, newest first.
func (r *ring[T]) newestFirst() []T {
	n := len(r.v)
	out := make([]T, n)
	for i := range n {
		out[i] = r.v[(r.oldest-1-i+2*n)%n] // the newest is just before the oldest
	}
	return out
}

// ended is one connection's end and duration, for the quantiles.
type ended struct {
	at time.Time
	d  time.Duration
}

func newStats() *stats {
	return &stats{recent: ring[Request]{size: recentKeep}, durs: ring[ended]{size: durKeep}}
}

// opened counts a connection that starts at now.
func (s *stats) opened(now time.Time) {
	s.open.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.total++
	b := &s.buckets[now.Unix()%rateWindow]
	if b.sec != now.Unix() {
		*b = bucket{sec: now.Unix()}
	}
	b.n++
}

// closed counts r's connection as over.
func (s *stats) closed(r Request) {
	s.open.Add(-1)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.durs.add(ended{at: r.Start.Add(r.Duration), d: r.Duration})
	s.recent.add(r)
}

// keep lists r among the recent requests.
func (s *stats) keep(r Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recent.add(r)
}

func (s *stats) snapshot(now time.Time) Stats {
	st := Stats{Open: s.open.Load(), P50: -1, P90: -1}
	s.mu.Lock()
	st.Total = s.total
	st.Rate1, st.Rate5 = s.rateLocked(now, 60), s.rateLocked(now, rateWindow)
	st.Recent = s.recent.newestFirst()
	ds := make([]time.Duration, 0, len(s.durs.v))
	for _, e := range s.durs.v {
		if now.Sub(e.at) < rateWindow*time.Second {
			ds = append(ds, e.d)
		}
	}
	s.mu.Unlock()
	if len(ds) > 0 {
		slices.Sort(ds)
		st.P50, st.P90 = rank(ds, 50), rank(ds, 90)
	}
	return st
}

// rank is the p-th percentile of sorted, by nearest rank.
func rank(sorted []time.Duration, p int) time.Duration {
	return sorted[max((len(sorted)*p+99)/100-1, 0)]
}

// rateLocked is connections a second over the window seconds up to now.
func (s *stats) rateLocked(now time.Time, window int64) float64 {
	var n int64
	for _, b := range s.buckets {
		if age := now.Unix() - b.sec; age >= 0 && age < window {
			n += b.n
		}
	}
	return float64(n) / float64(window)
}
