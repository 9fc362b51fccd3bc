package wan

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestShaperRateQueueDelay: at a rate, packets leave one after the other,
// each after its own time at the rate plus the delay; a packet that would
// overfill the queue is dropped, and the queue drains at the rate.
func TestShaperRateQueueDelay(t *testing.T) {
	s := newShaper(1)
	s.set(Link{Delay: 40 * time.Millisecond, Rate: 1000, Queue: 2500}) // 1 ms a byte
	t0 := time.Unix(1000, 0)
	for i, want := range []time.Duration{1000, 2000, 3000} { // ms after t0, before the delay
		due, ok := s.admit(t0, 1000)
		if i < 2 && (!ok || due != t0.Add(want*time.Millisecond+40*time.Millisecond)) {
			t.Fatalf("packet %d: due %v, %v; want %v after t0", i, due.Sub(t0), ok, want*time.Millisecond+40*time.Millisecond)
		}
		if i == 2 && ok {
			t.Fatalf("packet %d overfilled a 2500-byte queue holding 2000 and was kept", i)
		}
	}
	// 1.5 s later 500 bytes are still waiting: 2000 more fit, 2001 do not.
	later := t0.Add(1500 * time.Millisecond)
	if _, ok := s.admit(later, 2001); ok {
		t.Fatal("a packet beyond the drained queue was kept")
	}
	if due, ok := s.admit(later, 2000); !ok || due != t0.Add(4000*time.Millisecond+40*time.Millisecond) {
		t.Fatalf("packet after the drain: due %v, %v", due.Sub(t0), ok)
	}
	if st := s.stats(); st.Delivered != 3 || st.Overflow != 2 || st.Bytes != 4000 {
		t.Fatalf("stats %+v", st)
	}
	// Idle, the queue is empty: the next packet leaves at once.
	idle := t0.Add(time.Hour)
	if due, ok := s.admit(idle, 10); !ok || due != idle.Add(10*time.Millisecond+40*time.Millisecond) {
		t.Fatalf("packet on an idle link: due %v after arrival, %v", due.Sub(idle), ok)
	}
}

// TestShaperNoRate: without a rate every packet takes the delay alone.
func TestShaperNoRate(t *testing.T) {
	s := newShaper(1)
	s.set(Link{Delay: 25 * time.Millisecond})
	t0 := time.Unix(1000, 0)
	for range 1000 {
		if due, ok := s.admit(t0, 1500); !ok || due != t0.Add(25*time.Millisecond) {
			t.Fatalf("due %v, %v", due.Sub(t0), ok)
		}
	}
}

// TestShaperLoss: Bernoulli loss drops about the share it says, and a
// black hole drops everything until it is lifted.
func TestShaperLoss(t *testing.T) {
	s := newShaper(7)
	s.set(Link{Loss: 0.1})
	const n = 100000
	for range n {
		s.admit(time.Now(), 100)
	}
	// Binomial: mean 10000, standard deviation about 95.
	if lost := s.stats().Lost; lost < 9500 || lost > 10500 {
		t.Fatalf("lost %d of %d at 10%%", lost, n)
	}
	s.blackhole(true)
	for range 100 {
		if _, ok := s.admit(time.Now(), 100); ok {
			t.Fatal("a packet passed a black hole")
		}
	}
	s.blackhole(false)
	s.set(Link{})
	if _, ok := s.admit(time.Now(), 100); !ok {
		t.Fatal("a packet was dropped on a lossless link after the black hole")
	}
	if st := s.stats(); st.Blackholed != 100 {
		t.Fatalf("blackholed %d, want 100", st.Blackholed)
	}
}

func TestSymmetricProfiles(t *testing.T) {
	p, ok := ProfileByName("200ms-0.5%-20Mbit")
	if !ok {
		t.Fatal("no 200ms profile")
	}
	want := Link{Delay: 100 * time.Millisecond, Loss: 0.005, Rate: 2500000, Queue: 500000}
	if p.AtoB != want || p.BtoA != want {
		t.Fatalf("profile %+v, want %+v both ways", p, want)
	}
	for _, p := range Profiles {
		if q, ok := ProfileByName(p.Name); !ok || q != p {
			t.Errorf("profile %q parses as %+v, %v", p.Name, q, ok)
		}
	}
	if p, ok := ProfileByName("30ms-2Mbit"); !ok || p.AtoB != (Link{Delay: 15 * time.Millisecond, Rate: 250000, Queue: 7500}) {
		t.Errorf("30ms-2Mbit: %+v, %v", p, ok)
	}
	for _, bad := range []string{"nope", "50", "50ms-", "50ms-x%", "50ms-1%-2%", "50ms-0Mbit", "-5ms", "50ms-200%"} {
		if _, ok := ProfileByName(bad); ok {
			t.Errorf("%q parsed as a profile", bad)
		}
	}
}
