package mux

import "net/http"

// A relayed response's Content-Type is the local service's to give, and
// one that came without it reaches the visitor without it, as nginx and
// Envoy pass such a response on. net/http's servers (HTTP/1.1 and HTTP/2)
// would guess one from the first bytes of its body for a handler that set
// none: a type nobody sent, and one that can turn a JSON or text answer
// into text/html for a browser. Both the edge and the agent apply it.

// KeepUntyped keeps net/http's server from guessing a Content-Type for a
// response whose header h has none, by the means http.ResponseWriter
// documents: a nil value, which is written as no field at all. It is
// called before the final response's head is written.
func KeepUntyped(h http.Header) {
	if _, ok := h["Content-Type"]; !ok {
		h["Content-Type"] = nil
	}
}
