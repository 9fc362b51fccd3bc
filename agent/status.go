package agent

import "time"

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
	InstanceID string
	Hostname   string
	URL        string   // the first public URL, once bound
	URLs       []string // every public URL of the binding
	Local      string
	Generation uint64
	SessionID  uint64
	Attempt    int       // reconnect attempt number, while reconnecting
	NextRetry  time.Time // when the next attempt starts, while reconnecting
	Err        error     // why the last session ended, or why the agent stopped
}
