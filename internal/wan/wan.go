// Package wan emulates a wide-area link between two network namespaces,
// so that a tunnel's two sides can be measured over a real round trip,
// real loss and a real bottleneck on one machine whose kernel has no
// netem.
//
// A Pair is two fresh namespaces, A and B, each with a TUN device whose
// peer is the other side's address. A forwarder in this process reads each
// IP packet from one TUN device and writes it to the other after applying
// the link of that direction: a Bernoulli loss, a rate limit with a drop-
// tail queue, and a one-way delay. TCP's own congestion control and the
// tunnel's windows thus meet the link as they would on the internet.
//
// Invariant: every packet either leaves after its link's delay (and its
// turn at the rate) or is counted as dropped; the forwarder holds at most
// lineLimit packets per direction and never blocks its reader.
package wan

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Link is one direction of the emulated link.
type Link struct {
	// Delay is the one-way propagation delay; zero means none.
	Delay time.Duration
	// Loss is the probability that a packet is dropped, drawn
	// independently for each packet; zero means none.
	Loss float64
	// Rate is the bottleneck's rate in bytes per second; zero means no
	// limit (the forwarder's own speed).
	Rate int64
	// Queue bounds the bytes waiting for the rate; a packet that would
	// exceed it is dropped (drop-tail). Zero means 100 ms at Rate. Unused
	// without a Rate.
	Queue int
}

func (l Link) String() string {
	s := fmt.Sprintf("delay %v", l.Delay)
	if l.Loss > 0 {
		s += fmt.Sprintf(", loss %.2g%%", 100*l.Loss)
	}
	if l.Rate > 0 {
		s += fmt.Sprintf(", %.3g Mbit/s, queue %d B", float64(l.Rate)*8/1e6, l.queue())
	}
	return s
}

func (l Link) queue() int {
	if l.Queue > 0 {
		return l.Queue
	}
	return int(l.Rate / 10)
}

// Profile is a link in both directions: AtoB carries what side A sends.
type Profile struct {
	Name       string
	AtoB, BtoA Link
}

// Symmetric is a profile with the same link both ways: half the round
// trip rtt each way, loss each way, and rate with a queue of one
// bandwidth-delay product.
func Symmetric(name string, rtt time.Duration, loss float64, rate int64) Profile {
	l := Link{Delay: rtt / 2, Loss: loss, Rate: rate}
	if rate > 0 {
		l.Queue = int(float64(rate) * rtt.Seconds())
	}
	return Profile{Name: name, AtoB: l, BtoA: l}
}

// Profiles are the links the bench measures over by default.
var Profiles = []Profile{
	Symmetric("50ms", 50*time.Millisecond, 0, 0),
	Symmetric("100ms-1%", 100*time.Millisecond, 0.01, 0),
	Symmetric("200ms-0.5%-20Mbit", 200*time.Millisecond, 0.005, 20e6/8),
}

// ProfileByName returns the symmetric profile a name describes: a round
// trip in milliseconds, then optionally a loss in percent and a rate in
// Mbit/s, joined by dashes ("50ms", "100ms-1%", "200ms-0.5%-20Mbit",
// "200ms-20Mbit").
func ProfileByName(name string) (Profile, bool) {
	parts := strings.Split(name, "-")
	ms, ok := strings.CutSuffix(parts[0], "ms")
	rtt, err := strconv.ParseFloat(ms, 64)
	if !ok || err != nil || rtt < 0 {
		return Profile{}, false
	}
	var loss, rate float64
	for _, p := range parts[1:] {
		if pct, ok := strings.CutSuffix(p, "%"); ok && loss == 0 {
			if loss, err = strconv.ParseFloat(pct, 64); err != nil || loss <= 0 || loss > 100 {
				return Profile{}, false
			}
			continue
		}
		mbit, ok := strings.CutSuffix(p, "Mbit")
		if !ok || rate != 0 {
			return Profile{}, false
		}
		if rate, err = strconv.ParseFloat(mbit, 64); err != nil || rate <= 0 {
			return Profile{}, false
		}
	}
	return Symmetric(name, time.Duration(rtt*float64(time.Millisecond)), loss/100, int64(rate*1e6/8)), true
}

// Stats counts one direction's packets.
type Stats struct {
	Delivered, Bytes uint64 // written to the far side
	Lost             uint64 // dropped by the Bernoulli loss
	Overflow         uint64 // dropped by a full queue or a full delay line
	Blackholed       uint64 // dropped while the link was black-holed
	// Waited is the time the delivered packets waited for the rate, in
	// all: divided by Delivered, the queue's mean delay.
	Waited time.Duration
}
