package mux

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// ErrorHeader names the header on every response that ngstone (edge or
// agent) makes up itself rather than relays from the local service.
const ErrorHeader = "Ngstone-Error"

// UnsentHeader is set by a pool member's agent on its 502
// upstream_unreachable when nothing of the request reached its local
// service (the connection was never made): the edge may send a request
// without a body to another member. The edge drops it.
const UnsentHeader = "Ngstone-Unsent"

// Visitor error codes, the values of ErrorHeader.
const (
	CodeTunnelNotFound      = "tunnel_not_found"
	CodeTunnelOffline       = "tunnel_offline"
	CodeUpstreamUnreachable = "upstream_unreachable"
	CodeUpstreamTimeout     = "upstream_timeout"
	CodeTunnelInterrupted   = "tunnel_interrupted"
	CodeTunnelTimeout       = "tunnel_timeout"
	CodeBadHost             = "bad_host"
	CodeMisdirected         = "misdirected_request"
	CodeHeadersTooLarge     = "headers_too_large"
	CodeBodyTooLarge        = "body_too_large"
	CodeTooManyRequests     = "too_many_requests"
	CodeBasicAuthRequired   = "basic_auth_required"
	CodeBadResponse         = "bad_response"
	CodeMethodNotAllowed    = "method_not_allowed"
	CodeVisitorLimit        = "visitor_limit"
	CodeIPDenied            = "ip_denied"
	CodeWebhookUnverified   = "webhook_unverified"
	CodeOAuthRequired       = "oauth_required"
	CodeOAuthDenied         = "oauth_denied"
	CodeOAuthFailed         = "oauth_failed"
)

// visitorErrors maps each visitor error code to its status and a sentence
// template naming the hostname. It is the one place codes meet statuses.
var visitorErrors = map[string]struct {
	status int
	text   string
}{
	CodeTunnelNotFound:      {http.StatusNotFound, "no tunnel is bound to %s"},
	CodeTunnelOffline:       {http.StatusServiceUnavailable, "the agent serving %s is offline; retry shortly"},
	CodeUpstreamUnreachable: {http.StatusBadGateway, "the agent for %s could not connect to its local service"},
	CodeUpstreamTimeout:     {http.StatusGatewayTimeout, "the local service behind %s sent no response in time"},
	CodeTunnelInterrupted:   {http.StatusBadGateway, "the tunnel to %s was interrupted while the request was in flight"},
	CodeTunnelTimeout:       {http.StatusGatewayTimeout, "the agent for %s sent no response in time"},
	CodeBadHost:             {http.StatusBadRequest, "the request's Host %q is missing or malformed"},
	CodeMisdirected:         {http.StatusMisdirectedRequest, "this connection was not made for %s"},
	CodeHeadersTooLarge:     {http.StatusRequestHeaderFieldsTooLarge, "the request headers for %s are too large"},
	CodeBodyTooLarge:        {http.StatusRequestEntityTooLarge, "the request body for %s is too large"},
	CodeTooManyRequests:     {http.StatusServiceUnavailable, "the tunnel %s is at its limit of concurrent requests; retry shortly"},
	CodeBasicAuthRequired:   {http.StatusUnauthorized, "%s asks for a user name and password"},
	CodeBadResponse:         {http.StatusBadGateway, "the response for %s was malformed or its header section too large"},
	CodeBadRequest:          {http.StatusBadRequest, "the request for %s is malformed"},
	CodeMethodNotAllowed:    {http.StatusMethodNotAllowed, "%s does not take this method through the tunnel"},
	CodeVisitorLimit:        {http.StatusTooManyRequests, "this address has too many requests in flight to %s; retry shortly"},
	CodeIPDenied:            {http.StatusForbidden, "%s lets in only the visitor addresses its agent allows, and not this one"},
	CodeWebhookUnverified:   {http.StatusForbidden, "%s takes only webhooks signed with its secret, and this request's signature did not verify"},
	CodeOAuthRequired:       {http.StatusUnauthorized, "%s lets in only visitors signed in with its provider: open it in a browser to sign in"},
	CodeOAuthDenied:         {http.StatusForbidden, "%s lets in only the visitors its agent allows, and the one signed in is not one of them"},
	CodeOAuthFailed:         {http.StatusBadRequest, "the sign-in for %s did not complete: open the tunnel's address again to start over"},
}

// VisitorStatus returns the HTTP status of a visitor error code (502 for an
// unknown code).
func VisitorStatus(code string) int {
	if e, ok := visitorErrors[code]; ok {
		return e.status
	}
	return http.StatusBadGateway
}

// WriteVisitorError answers a visitor with code's status, the ErrorHeader
// and a one-line body naming host. 503s carry Retry-After.
func WriteVisitorError(w http.ResponseWriter, code, host string) {
	writeVisitorError(w, code, host, "")
}

// writeVisitorError is WriteVisitorError with why, when not empty, said
// after the code's sentence.
func writeVisitorError(w http.ResponseWriter, code, host, why string) {
	e, ok := visitorErrors[code]
	if !ok {
		e = visitorErrors[CodeTunnelInterrupted]
	}
	h := w.Header()
	h.Set(ErrorHeader, code)
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	switch e.status {
	case http.StatusServiceUnavailable, http.StatusTooManyRequests:
		h.Set("Retry-After", "1")
	case http.StatusMethodNotAllowed:
		h.Set("Allow", "GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS")
	case http.StatusUnauthorized:
		if code == CodeOAuthRequired {
			// A scheme of ngstone's own: a browser signs in at the
			// provider's page, and prompts for no password.
			h.Set("WWW-Authenticate", `Ngstone-Sign-In realm="ngstone"`)
			break
		}
		h.Set("WWW-Authenticate", `Basic realm="ngstone", charset="UTF-8"`)
	}
	w.WriteHeader(e.status)
	fmt.Fprintf(w, e.text+"%s (%s)\n", host, because(why), code)
}

func because(why string) string {
	if why == "" {
		return ""
	}
	return ": " + why
}

// WriteVisitorErrorFor is WriteVisitorError for the request r: a gRPC
// request (Content-Type application/grpc) gets the answer gRPC clients
// read, a grpc-status in a response without a body (gRPC's Trailers-Only),
// beside the same status and ErrorHeader.
func WriteVisitorErrorFor(w http.ResponseWriter, r *http.Request, code, host string) {
	WriteVisitorErrorWhy(w, r, code, host, "")
}

// WriteVisitorErrorWhy is WriteVisitorErrorFor with why, when not empty,
// said after the code's sentence: what a person can act on.
func WriteVisitorErrorWhy(w http.ResponseWriter, r *http.Request, code, host, why string) {
	if !IsGRPC(r) {
		writeVisitorError(w, code, host, why)
		return
	}
	e, ok := visitorErrors[code]
	if !ok {
		e = visitorErrors[CodeTunnelInterrupted]
	}
	h := w.Header()
	h.Set(ErrorHeader, code)
	h.Set("Content-Type", "application/grpc")
	h.Set("Grpc-Status", strconv.Itoa(grpcCode(e.status)))
	h.Set("Grpc-Message", url.PathEscape(fmt.Sprintf(e.text+"%s (%s)", host, because(why), code)))
	h.Set("Content-Length", "0")
	w.WriteHeader(e.status)
}

// IsGRPC reports whether r is a gRPC call.
func IsGRPC(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	return ct == "application/grpc" || strings.HasPrefix(ct, "application/grpc+") || strings.HasPrefix(ct, "application/grpc;")
}

// grpcCode is the gRPC status of an HTTP status, by gRPC's own table
// (doc/http-grpc-status-mapping.md), with a body or head too large as
// RESOURCE_EXHAUSTED.
func grpcCode(status int) int {
	switch status {
	case http.StatusBadRequest:
		return 13 // INTERNAL
	case http.StatusUnauthorized:
		return 16 // UNAUTHENTICATED
	case http.StatusForbidden:
		return 7 // PERMISSION_DENIED
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		return 12 // UNIMPLEMENTED
	case http.StatusRequestEntityTooLarge, http.StatusRequestHeaderFieldsTooLarge:
		return 8 // RESOURCE_EXHAUSTED
	case http.StatusTooManyRequests, http.StatusMisdirectedRequest, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return 14 // UNAVAILABLE
	}
	return 2 // UNKNOWN
}

// AppendVisitorError appends to b the whole HTTP/1.1 response that
// WriteVisitorError makes, for a writer without an http.ResponseWriter.
func AppendVisitorError(b []byte, code, host string) []byte {
	var w responseBuffer
	w.header = http.Header{}
	WriteVisitorError(&w, code, host)
	resp := http.Response{
		StatusCode:    w.status,
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        w.header,
		ContentLength: int64(w.body.Len()),
		Body:          io.NopCloser(&w.body),
	}
	var out bytes.Buffer
	resp.Write(&out)
	return append(b, out.Bytes()...)
}

// responseBuffer records one response.
type responseBuffer struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (w *responseBuffer) Header() http.Header         { return w.header }
func (w *responseBuffer) WriteHeader(status int)      { w.status = status }
func (w *responseBuffer) Write(p []byte) (int, error) { return w.body.Write(p) }

// WriteJSON answers with status and v as indented JSON: the edge's admin
// API and the agent's inspector.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}
