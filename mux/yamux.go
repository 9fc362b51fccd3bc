package mux

import (
	"fmt"
	"io"
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
	// 8 MiB. yamux's minimum is 256 KiB. One stream carries at most a
	// window per round trip: 8 MiB is about 80 MB/s at 100 ms. A stream
	// whose reader stalls holds up to its window unread, in a buffer of up
	// to about twice that (yamux's bytes.Buffer doubles as it fills); the
	// data sent, not the window, is what is held while the reader keeps up.
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
		StreamWindow:           8 << 20,
		AcceptBacklog:          256,
	}
}

// Yamux returns a yamux configuration from c, filling zero fields with
// defaults. Logs from yamux go to logOut (io.Discard when nil).
func (c Config) Yamux(logOut io.Writer) (*yamux.Config, error) {
	d := DefaultConfig()
	if c.KeepAliveInterval <= 0 {
		c.KeepAliveInterval = d.KeepAliveInterval
	}
	if c.ConnectionWriteTimeout <= 0 {
		c.ConnectionWriteTimeout = d.ConnectionWriteTimeout
	}
	if c.StreamWindow == 0 {
		c.StreamWindow = d.StreamWindow
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
