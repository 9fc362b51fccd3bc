package registry

import "time"

// SetClock sets the clock m reads (bind times, reservations' ends), so
// that a test can move time on.
func (m *Memory) SetClock(now func() time.Time) {
	m.mu.Lock()
	m.now = now
	m.mu.Unlock()
}

// SetClock sets the clock s reads, as for Memory.
func (s *Bolt) SetClock(now func() time.Time) {
	s.mu.Lock()
	s.now = now
	s.mu.Unlock()
}

// SetClock sets the clock of s's reservations (bind times stay real).
func (s *Etcd) SetClock(now func() time.Time) {
	s.mu.Lock()
	s.now = now
	s.mu.Unlock()
}
