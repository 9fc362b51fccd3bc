package agent

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// The console's and the local API's counters, as ngrok's show them: each
// exchange the edge opens a stream for is one connection. The quantiles
// are a prometheus summary's (a streaming estimate over the last five
// minutes), not kept durations.

const (
	// rateWindow is the longest rate the counters give (5 minutes), in
	// one-second buckets.
	rateWindow = 300
	// recentKeep is how many ended requests the console can show.
	recentKeep = 64
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
	open    atomic.Int64
	summary prometheus.Summary

	mu      sync.Mutex
	total   int64
	buckets [rateWindow]bucket
	recent  []Request // up to recentKeep; once full, the oldest at recent[oldest]
	oldest  int       // where the next request goes once recent is full
}

func newStats() *stats {
	return &stats{summary: prometheus.NewSummary(prometheus.SummaryOpts{
		Name:       "ngstone_agent_connection_duration_seconds",
		Help:       "Durations of the agent's connections.",
		Objectives: map[float64]float64{0.5: 0.01, 0.9: 0.005},
		MaxAge:     5 * time.Minute,
		AgeBuckets: 5,
	})}
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
	s.summary.Observe(r.Duration.Seconds())
	s.keep(r)
}

// keep lists r among the recent requests.
func (s *stats) keep(r Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.recent) < recentKeep {
		s.recent = append(s.recent, r)
		return
	}
	s.recent[s.oldest] = r
	s.oldest = (s.oldest + 1) % recentKeep
}

func (s *stats) snapshot(now time.Time) Stats {
	st := Stats{Open: s.open.Load(), P50: -1, P90: -1}
	s.mu.Lock()
	st.Total = s.total
	st.Rate1, st.Rate5 = s.rateLocked(now, 60), s.rateLocked(now, rateWindow)
	n := len(s.recent)
	st.Recent = make([]Request, n)
	for i := range n {
		// The newest is just before the oldest.
		st.Recent[i] = s.recent[(s.oldest-1-i+2*n)%n]
	}
	s.mu.Unlock()
	var m dto.Metric
	if s.summary.Write(&m) == nil {
		for _, q := range m.GetSummary().GetQuantile() {
			v := q.GetValue()
			if math.IsNaN(v) {
				continue
			}
			d := time.Duration(v * float64(time.Second))
			switch q.GetQuantile() {
			case 0.5:
				st.P50 = d
			case 0.9:
				st.P90 = d
			}
		}
	}
	return st
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
