package registry

import (
	"slices"
	"testing"
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
