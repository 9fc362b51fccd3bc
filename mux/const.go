// Package mux is ngstone's wire protocol between an agent and the edge.
//
// An agent dials the edge's control address over TLS and runs a yamux client
// session on that connection. The first stream the agent opens is the control
// stream; it carries length-prefixed frames (see spec.md): hello, bind,
// heartbeat, evicted, unbind, goaway. Every other stream is opened by the edge
// and carries HTTP/1.1 exchanges one after another, as a keep-alive
// connection does; a TCP tunnel's connection is one exchange (spec.md).
//
// The package owns the wire only: message types, framing, limits, the names a
// bind may carry (ValidateSubdomain, ValidateHostname) and the yamux settings
// both sides use. It opens no sockets and makes no policy.
package mux

import "errors"

// Version is the protocol version an agent states in its hello. The edge
// refuses a hello with another major version.
const Version = 1

// ALPN is the protocol name the control listener negotiates over TLS.
const ALPN = "ngstone/1"

// MaxFrameSize bounds a control frame's payload. A larger length closes the
// session: no legitimate message comes near it.
const MaxFrameSize = 64 << 10

// Max1xx bounds the informational (1xx) responses before the final one
// that the agent passes on from a local service. The edge reads at most
// Max1xx+1 from an agent: those, and the agent's own 100 Continue.
const Max1xx = 16

// MaxResponseHead is the default bound of a response head, informational
// heads included, that the edge takes from an agent (its
// --max-response-head), and the most the agent takes from a local service:
// the edge states its own bound in hello_ok, and the agent holds local
// services to the smaller of the two, so that whatever the agent passes
// on, the edge accepts.
const MaxResponseHead = 1 << 20

// MaxRequestHead bounds a request head the agent takes from the edge: the
// edge holds visitors to 64 KiB, and adds a few fields of its own.
const MaxRequestHead = 1 << 20

// headerSize is the frame header: one byte of type, four of payload length.
const headerSize = 5

// Type identifies a control message. The values are part of the wire
// protocol: never renumber them.
type Type uint8

// Control message types.
const (
	TypeHello        Type = 1  // agent → edge, first frame
	TypeHelloOK      Type = 2  // edge → agent, answers hello
	TypeBind         Type = 3  // agent → edge
	TypeBindOK       Type = 4  // edge → agent
	TypeBindError    Type = 5  // edge → agent; final, never retried
	TypeHeartbeat    Type = 6  // agent → edge
	TypeHeartbeatAck Type = 7  // edge → agent
	TypeEvicted      Type = 8  // edge → agent: a binding was taken from this session
	TypeUnbind       Type = 9  // agent → edge: graceful release
	TypeUnbound      Type = 10 // edge → agent: answers unbind
	TypeGoAway       Type = 11 // edge → agent: the edge is shutting down, reconnect
	TypeError        Type = 12 // edge → agent: a fatal session error (bad hello, unauthorized)
	TypeRefused      Type = 13 // edge → agent: a request the edge refused for a tunnel (FeatureWebhook)
	TypeHealth       Type = 14 // agent → edge: a pool member's local service failing or back (FeaturePool)
)

var typeNames = map[Type]string{
	TypeHello: "hello", TypeHelloOK: "hello_ok", TypeBind: "bind", TypeBindOK: "bind_ok",
	TypeBindError: "bind_error", TypeHeartbeat: "heartbeat", TypeHeartbeatAck: "heartbeat_ack",
	TypeEvicted: "evicted", TypeUnbind: "unbind", TypeUnbound: "unbound", TypeGoAway: "goaway",
	TypeError: "error", TypeRefused: "refused", TypeHealth: "health",
}

func (t Type) String() string {
	if n, ok := typeNames[t]; ok {
		return n
	}
	return "unknown"
}

// Known reports whether t is a message type of this protocol version.
func (t Type) Known() bool { _, ok := typeNames[t]; return ok }

// Error codes carried in bind_error and error messages. They are the same
// strings users see and scripts match on.
const (
	CodeSubdomainTaken = "subdomain_taken"
	CodeInvalidName    = "invalid_name"
	CodeReservedName   = "reserved_name"
	CodeUnauthorized   = "unauthorized"
	CodeLimitExceeded  = "limit_exceeded"
	CodeBadRequest     = "bad_request"
	CodeShuttingDown   = "shutting_down"
	CodeUnavailable    = "unavailable"
	CodeVersion        = "unsupported_version"
	// CodeTooManyFailures refuses a hello from an address that failed
	// too many hellos lately; Error.RetryAfterMS says when to try again.
	CodeTooManyFailures = "too_many_failures"
)

// Retryable reports whether an agent should retry after an error or
// bind_error with code, rather than stop: the edge is going away or could
// not decide, not refusing.
func Retryable(code string) bool {
	return code == CodeShuttingDown || code == CodeUnavailable || code == CodeTooManyFailures
}

// Eviction reasons.
const (
	ReasonTakeover = "takeover"
)

// Sentinel errors returned by ReadFrame.
var (
	// ErrFrameTooLarge means a frame announced a payload over MaxFrameSize.
	ErrFrameTooLarge = errors.New("mux: control frame too large")
	// ErrUnknownType means a frame's type byte is not a known message type.
	ErrUnknownType = errors.New("mux: unknown control message type")
	// ErrMalformed means a frame's payload did not decode as its type.
	ErrMalformed = errors.New("mux: malformed control message")
)

// InitialWindow is what yamux lets a new stream send before the peer has
// accepted it: every stream starts with a 256 KiB window (yamux's spec).
const InitialWindow = 256 << 10
