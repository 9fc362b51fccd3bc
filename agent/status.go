package agent

import (
	"net/url"
	"time"

	"github.com/ngstone/ngstone/mux"
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
	// EvictedBy is what the edge said of the agent that holds the name
	// now (mux.Holder); zero when it said nothing.
	EvictedBy mux.Holder
	// Tunnels is each tunnel's state, in the order of the configuration.
	// Hostname, URL, URLs, Local and Generation above are the first
	// tunnel's that holds its name (the first's when none does).
	Tunnels []TunnelStatus
}

// TunnelState is where one tunnel's name stands.
type TunnelState string

// Tunnel states.
const (
	// TunnelConnecting: not bound on the current session yet.
	TunnelConnecting TunnelState = "connecting"
	// TunnelOnline: bound on the current session.
	TunnelOnline TunnelState = "online"
	// TunnelRefused: the edge refused the name (final).
	TunnelRefused TunnelState = "refused"
	// TunnelEvicted: another agent took the name over (final).
	TunnelEvicted TunnelState = "evicted"
)

// TunnelStatus is one tunnel's part of the status.
type TunnelStatus struct {
	Name  string // the tunnel's name; "command_line" for the command line's
	Local string // the local service's URL
	// VerifyWebhook is the provider whose signatures the edge checks
	// (--verify-webhook); empty if none.
	VerifyWebhook string
	// OAuth is the provider visitors sign in with (--oauth); empty if none.
	OAuth string
	// Pool: the name is shared with the other agents of the token that
	// asked for it with --pool; Down is why this one's local service is
	// out of the pool now ("" while it answers).
	Pool       bool
	Down       string
	State      TunnelState
	Hostname   string   // once bound
	URL        string   // the first public URL, once bound
	URLs       []string // every public URL of the binding
	Generation uint64
	// Err is why the name was refused or lost; nil otherwise.
	Err error
	// EvictedReason is the reason the edge gave when it took the name away.
	EvictedReason string
	// EvictedBy is what it said of the agent that holds the name now.
	EvictedBy mux.Holder
}

// Endpoint is one public URL the agent serves, as the local API and the
// console list it.
type Endpoint struct {
	// Name is ngrok's: the tunnel's name ("command_line" for the command
	// line's) for its first URL, "NAME (SCHEME)" for the others.
	Name      string
	Tunnel    string // the tunnel's name
	Proto     string // the public URL's scheme: https or http
	PublicURL string
	Local     string // the local service's URL
	// VerifyWebhook is the tunnel's --verify-webhook provider, if any.
	VerifyWebhook string
	// OAuth is the tunnel's --oauth provider, if any.
	OAuth string
	// Pool and Down are the tunnel's (TunnelStatus).
	Pool bool
	Down string
}

// Endpoints lists the public URLs of the tunnels that hold their names,
// each tunnel's first (HTTPS when the edge has it) first. An agent that
// lost its names (evicted, stopped) lists none.
func (s Status) Endpoints() []Endpoint {
	out := []Endpoint{}
	for _, t := range s.Tunnels {
		if t.State == TunnelRefused || t.State == TunnelEvicted {
			continue
		}
		for i, u := range t.URLs {
			proto := "http"
			if pu, err := url.Parse(u); err == nil {
				proto = pu.Scheme
			}
			name := t.Name
			if i > 0 {
				name += " (" + proto + ")"
			}
			out = append(out, Endpoint{Name: name, Tunnel: t.Name, Proto: proto, PublicURL: u, Local: t.Local, VerifyWebhook: t.VerifyWebhook, OAuth: t.OAuth,
				Pool: t.Pool, Down: t.Down})
		}
	}
	return out
}
