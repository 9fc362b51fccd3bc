package agent

import (
	"testing"
	"time"
)

// TestStats: totals, open count, rates over 1 and 5 minutes from one-second
// buckets (old buckets drop out), the quantiles of the durations, and the
// recent list bounded and newest first.
func TestStats(t *testing.T) {
	s := newStats()
	t0 := time.Unix(1_000_000, 0)
	if st := s.snapshot(t0); st.Total != 0 || st.P50 != -1 || st.P90 != -1 || st.Rate1 != 0 {
		t.Fatalf("empty: %+v", st)
	}
	// 120 connections 6 minutes ago, then 1 a second for the last 100 s.
	for range 120 {
		s.opened(t0)
		s.closed(Request{Start: t0, Duration: time.Second})
	}
	now := t0.Add(6 * time.Minute)
	for i := range 100 {
		at := now.Add(time.Duration(i-99) * time.Second)
		s.opened(at)
		s.closed(Request{Start: at, Path: "/" + string(rune('a'+i%26)), Duration: time.Duration(i+1) * time.Millisecond})
	}
	s.opened(now) // one still open
	st := s.snapshot(now)
	if st.Total != 221 || st.Open != 1 {
		t.Errorf("total %d open %d, want 221 and 1", st.Total, st.Open)
	}
	// The last 60 s hold 60 of the 100, plus the open one (61); the last
	// 300 s all 101, not the 120 of 6 minutes ago.
	if want := 61.0 / 60; st.Rate1 != want {
		t.Errorf("rate1 %.3f, want %.3f", st.Rate1, want)
	}
	if want := 101.0 / 300; st.Rate5 != want {
		t.Errorf("rate5 %.3f, want %.3f", st.Rate5, want)
	}
	// The quantiles are of the last 5 minutes too: the 100 of 1..100 ms,
	// not the 120 of 1 s.
	if st.P50 != 50*time.Millisecond || st.P90 != 90*time.Millisecond {
		t.Errorf("p50 %s p90 %s, want 50ms and 90ms", st.P50, st.P90)
	}
	if len(st.Recent) != recentKeep || st.Recent[0].Duration != 100*time.Millisecond || st.Recent[recentKeep-1].Duration != 37*time.Millisecond {
		t.Errorf("recent: %d kept, newest %s, oldest %s", len(st.Recent), st.Recent[0].Duration, st.Recent[len(st.Recent)-1].Duration)
	}
}

// TestStatsRecentRing: around the ring of recent requests more than once,
// the last recentKeep newest first.
func TestStatsRecentRing(t *testing.T) {
	s := newStats()
	for i := range 3*recentKeep + 5 {
		s.keep(Request{Status: i})
	}
	st := s.snapshot(time.Now())
	if len(st.Recent) != recentKeep {
		t.Fatalf("%d kept, want %d", len(st.Recent), recentKeep)
	}
	for i, r := range st.Recent {
		if want := 3*recentKeep + 4 - i; r.Status != want {
			t.Fatalf("recent[%d] is request %d, want %d", i, r.Status, want)
		}
	}
}

// TestStatsQuantiles: p50 and p90 of 1..1000 ms, by nearest rank; past
// durKeep, of the last durKeep; and of one duration, that one.
func TestStatsQuantiles(t *testing.T) {
	s := newStats()
	now := time.Now()
	closeAfter := func(d time.Duration) {
		s.opened(now.Add(-d))
		s.closed(Request{Start: now.Add(-d), Duration: d})
	}
	closeAfter(time.Hour) // ended now: counted, and the longest
	if st := s.snapshot(now); st.P50 != time.Hour || st.P90 != time.Hour {
		t.Errorf("one duration: p50 %s p90 %s, want 1h", st.P50, st.P90)
	}
	s = newStats()
	for i := range 1000 {
		closeAfter(time.Duration(i+1) * time.Millisecond)
	}
	if st := s.snapshot(now); st.P50 != 500*time.Millisecond || st.P90 != 900*time.Millisecond {
		t.Errorf("p50 %s p90 %s, want 500ms and 900ms", st.P50, st.P90)
	}
	for range durKeep {
		closeAfter(2 * time.Second)
	}
	if st := s.snapshot(now); st.P50 != 2*time.Second || st.P90 != 2*time.Second || len(s.durs.v) != durKeep {
		t.Errorf("after durKeep more of 2s: p50 %s p90 %s, %d kept", st.P50, st.P90, len(s.durs.v))
	}
}
