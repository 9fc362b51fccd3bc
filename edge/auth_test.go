package edge

import (
	"fmt"
	"testing"
	"time"
)

// TestAuthLimiterBounded: bans hold while a spray of other addresses fails
// (70,000 of them, past the limiter's tables), the tables stay within
// their bound, and the addresses of one IPv6 /64 count as one.
func TestAuthLimiterBounded(t *testing.T) {
	l := newAuthLimiter(5, time.Minute)
	now := time.Now()
	for range 5 {
		l.fail("192.0.2.7:4000", now)
	}
	if _, _, banned := l.banned("192.0.2.7:5000", now); !banned {
		t.Fatal("five failures did not ban the address")
	}
	for i := range 70000 {
		addr := fmt.Sprintf("10.%d.%d.%d:1", i>>16, (i>>8)&0xff, i&0xff)
		if l.fail(addr, now) {
			t.Fatalf("one failure banned %s", addr)
		}
	}
	if until, answer, banned := l.banned("192.0.2.7:5000", now.Add(time.Second)); !banned || !answer || !until.Equal(now.Add(time.Minute)) {
		t.Fatalf("after a spray of 70,000 addresses: banned %v until %v (answer %v), want the ban in force until %v", banned, until, answer, now.Add(time.Minute))
	}
	if _, answer, _ := l.banned("192.0.2.7:5000", now.Add(1500*time.Millisecond)); answer {
		t.Error("a banned address was told why twice within a second")
	}
	if n, m := l.failures.Len(), l.bans.Len(); n > maxAuthStates || m > maxAuthStates {
		t.Fatalf("tables hold %d failures and %d bans, over %d", n, m, maxAuthStates)
	}

	for i := range 5 {
		l.fail(fmt.Sprintf("[2001:db8:1:2::%x]:1", i+1), now)
	}
	if _, _, banned := l.banned("[2001:db8:1:2:ffff::1]:1", now); !banned {
		t.Fatal("five failures from one IPv6 /64 did not ban it")
	}
	if _, _, banned := l.banned("[2001:db8:1:3::1]:1", now); banned {
		t.Fatal("a ban of one /64 reached the next")
	}

	l.sweep(now.Add(2 * time.Minute))
	if _, _, banned := l.banned("192.0.2.7:5000", now.Add(2*time.Minute)); banned || l.failures.Len() != 0 || l.bans.Len() != 0 {
		t.Fatalf("after the window: banned %v, %d failures and %d bans kept", banned, l.failures.Len(), l.bans.Len())
	}
}
