package mux

import (
	"fmt"
	"io"
	"net"
	"time"

	"github.com/hashicorp/yamux"
)

// Config is the yamux tuning both sides share.
type Config struct {
	// KeepAliveInterval is yamux's ping interval; zero means 15s.
	KeepAliveInterval time.Duration
	// ConnectionWriteTimeout bounds one write to the connection; a path that
	// stays blocked longer closes the session. Zero means 10s.
	ConnectionWriteTimeout time.Duration
	// StreamWindow is each stream's receive window in bytes; zero means
	// sized to the connection's round trip (WindowFor). yamux's minimum is
	// 256 KiB. One stream carries at most a window per round trip. A
	// stream whose reader stalls holds up to its window unread in yamux's
	// buffer; while the reader keeps up, only what is in flight is held.
	// BENCHMARKS.md has the measurements behind the choice.
	StreamWindow uint32
	// AcceptBacklog bounds streams opened but not yet accepted; zero means 256.
	AcceptBacklog int
}

// DefaultConfig returns the settings ngstone uses.
func DefaultConfig() Config {
	return Config{
		KeepAliveInterval:      15 * time.Second,
		ConnectionWriteTimeout: 10 * time.Second,
		AcceptBacklog:          256,
	}
}

// The stream window sized to a connection's round trip (WindowFor).
const (
	// MinWindow is the window of a connection whose round trip is short
	// or unknown: loopback, a LAN, the tests. It is what a stalled reader
	// can make a stream hold there.
	MinWindow = 1 << 20
	// MaxWindow bounds the window of a long round trip: what a stalled
	// reader can make a stream hold over a WAN.
	MaxWindow = 8 << 20
	// windowRate is the rate one stream should reach at any round trip
	// up to MaxWindow / windowRate (65 ms), in bytes per second: above
	// what the links of BENCHMARKS.md's WAN runs carry.
	windowRate = 128_000_000
)

// WindowFor is the stream window for a connection whose smoothed round
// trip is rtt: a window per round trip at windowRate, within [MinWindow,
// MaxWindow]. A fixed large window would let each stalled stream of a
// local session hold megabytes for no gain; a fixed small one caps a
// stream over a WAN at window / rtt (1 MiB at 50 ms: 20 MB/s).
func WindowFor(rtt time.Duration) uint32 {
	w := int64(rtt.Seconds() * windowRate)
	return uint32(min(max(w, MinWindow), MaxWindow))
}

// YamuxConn is Yamux for a session over conn: a zero StreamWindow is
// sized to conn's round trip as the kernel has measured it (the TCP and
// TLS handshakes give it samples), MinWindow where that is unknown.
func (c Config) YamuxConn(conn net.Conn, logOut io.Writer) (*yamux.Config, error) {
	if c.StreamWindow == 0 {
		c.StreamWindow = WindowFor(roundTrip(conn))
	}
	return c.Yamux(logOut)
}

// roundTrip is the smoothed round trip of the TCP connection beneath c,
// or zero.
func roundTrip(c net.Conn) time.Duration {
	tc := tcpUnder(c)
	if tc == nil {
		return 0
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return 0
	}
	var rtt time.Duration
	rc.Control(func(fd uintptr) { rtt = tcpRTT(fd) })
	return rtt
}

// Yamux returns a yamux configuration from c, filling zero fields with
// defaults (a zero StreamWindow is MinWindow). Logs from yamux go to
// logOut (io.Discard when nil).
func (c Config) Yamux(logOut io.Writer) (*yamux.Config, error) {
	d := DefaultConfig()
	if c.KeepAliveInterval <= 0 {
		c.KeepAliveInterval = d.KeepAliveInterval
	}
	if c.ConnectionWriteTimeout <= 0 {
		c.ConnectionWriteTimeout = d.ConnectionWriteTimeout
	}
	if c.StreamWindow == 0 {
		c.StreamWindow = MinWindow
	}
	if c.AcceptBacklog <= 0 {
		c.AcceptBacklog = d.AcceptBacklog
	}
	if logOut == nil {
		logOut = io.Discard
	}
	yc := yamux.DefaultConfig()
	yc.EnableKeepAlive = true
	yc.KeepAliveInterval = c.KeepAliveInterval
	yc.ConnectionWriteTimeout = c.ConnectionWriteTimeout
	yc.MaxStreamWindowSize = c.StreamWindow
	yc.AcceptBacklog = c.AcceptBacklog
	// No open timeout: yamux would run a goroutine and a timer for each
	// stream until its ACK, a cost on every request. The edge bounds an
	// exchange with its tunnel timeout, and heartbeats find a dead agent.
	yc.StreamOpenTimeout = 0
	yc.StreamCloseTimeout = 5 * time.Minute
	yc.LogOutput = logOut
	if err := yamux.VerifyConfig(yc); err != nil {
		return nil, fmt.Errorf("yamux config: %w", err)
	}
	return yc, nil
}
