package registry

import (
	"slices"
	"testing"
	"time"
)

// TestNextMember: a lane is opened when those open are behind, so it goes
// to a member that carries none of them, in turn; with every member
// carrying one, to the next in turn (a fresh stream on a member is still
// worth a try).
func TestNextMember(t *testing.T) {
	s := NewEtcd(EtcdConfig{Endpoints: []string{"http://m0", "http://m1", "http://m2"}})
	on := func(ms ...int) []*lane {
		var ls []*lane
		for _, m := range ms {
			ls = append(ls, &lane{member: m})
		}
		return ls
	}
	for _, tc := range []struct {
		name  string
		turn  int
		lanes []*lane
		want  int
	}{
		{"none open: its turn", 1, nil, 1},
		{"its turn taken: the next", 0, on(0), 1},
		{"two taken: the third", 0, on(0, 1), 2},
		{"two taken, from the last: around", 2, on(2, 0), 1},
		{"all taken: its turn", 1, on(0, 1, 2), 1},
	} {
		s.members.turn = tc.turn
		if got := s.nextMember(tc.lanes); got != tc.want {
			t.Errorf("%s: member %d, want %d", tc.name, got, tc.want)
		}
	}
	s.members.turn = 0
	var got []int
	for range 4 {
		got = append(got, s.nextMember(nil))
	}
	if want := []int{0, 1, 2, 0}; !slices.Equal(got, want) {
		t.Errorf("turns %v, want %v: lanes must rotate over the members", got, want)
	}
}

// TestLongestBehind: with every lane behind and no room for another, the
// lane given up is one that has not answered yet (still opening, or its
// first request unanswered), the longest behind of those; a lane that has
// answered goes only when all have, though its oldest request be older
// than an opening: it may be the only one answering, late.
func TestLongestBehind(t *testing.T) {
	now := time.Now()
	at := func(ago time.Duration, heard bool) *lane {
		return &lane{sent: []time.Time{now.Add(-ago)}, heard: heard}
	}
	for _, tc := range []struct {
		name  string
		lanes []*lane
		want  int
	}{
		{"answering late, two opening", []*lane{at(450*time.Millisecond, true), at(350*time.Millisecond, false), at(320*time.Millisecond, false)}, 1},
		{"the opening one, wherever it is", []*lane{at(time.Second, true), at(2*time.Second, true), at(400*time.Millisecond, false)}, 2},
		{"all answered: the longest behind", []*lane{at(time.Second, true), at(3*time.Second, true), at(2*time.Second, true)}, 1},
		{"none answered: the longest behind", []*lane{at(time.Second, false), at(2*time.Second, false), at(3*time.Second, false)}, 2},
	} {
		if got := longestBehind(tc.lanes); got != tc.want {
			t.Errorf("%s: lane %d given up, want %d", tc.name, got, tc.want)
		}
	}
}
