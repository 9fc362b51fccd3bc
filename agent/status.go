package agent

import (
	"net/url"
	"time"
)

// State is the agent's connection state.
type State string

// States, in the order a healthy agent passes through them.
const (
	StateConnecting   State = "connecting"
	StateOnline       State = "online"
	StateReconnecting State = "reconnecting"
	StateEvicted      State = "evicted"
	StateStopped      State = "stopped"
	StateFailed       State = "failed"
)

// Status is a snapshot of the agent for status output.
type Status struct {
	State      State
	InstanceID string // the digest of the instance id, never the secret
	Edge       string // the edge's control address
	Hostname   string
	URL        string   // the first public URL, once bound
	URLs       []string // every public URL of the binding
	Local      string
	Generation uint64
	SessionID  uint64
	// Since is when State began. While reconnecting it stays the time the
	// session was lost, whatever the attempt.
	Since     time.Time
	Attempt   int       // reconnect attempt number, while reconnecting
	NextRetry time.Time // when the next attempt starts, while reconnecting
	Err       error     // why the last session ended, or why the agent stopped
	// Hint is what a person can do about Err (the flag to pass, the
	// address to check); empty when the agent knows nothing better than
	// to retry.
	Hint string
	// Latency is the last round trip to the edge: the hello at first, then
	// each heartbeat to its answer. Zero before the first.
	Latency time.Duration
	// InspectURL is where the inspector and the local API answer; empty
	// when they are off.
	InspectURL string
	// EvictedReason is the reason the edge gave when it took the name away
	// (takeover: another agent holds it now).
	EvictedReason string
}

// Tunnel is one public URL the agent serves, as the local API and the
// console list it.
type Tunnel struct {
	// Name is ngrok's for a command-line tunnel: "command_line" for the
	// first URL, "command_line (SCHEME)" for the others.
	Name      string
	Proto     string // the public URL's scheme: https or http
	PublicURL string
	Local     string // the local service's URL
}

// Tunnels lists the public URLs of s, the first (HTTPS when the edge has
// it) first. An agent that lost its name (evicted, stopped) lists none.
func (s Status) Tunnels() []Tunnel {
	out := make([]Tunnel, 0, len(s.URLs))
	for i, u := range s.URLs {
		proto := "http"
		if pu, err := url.Parse(u); err == nil {
			proto = pu.Scheme
		}
		name := "command_line"
		if i > 0 {
			name += " (" + proto + ")"
		}
		out = append(out, Tunnel{Name: name, Proto: proto, PublicURL: u, Local: s.Local})
	}
	return out
}
