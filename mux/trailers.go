package mux

import (
	"io"
	"net/http"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Trailers cross the tunnel as the message declared them: a proxy's
// outgoing request carries the trailer fields the visitor's request named
// in its Trailer field before the body, never one it sent undeclared, and
// never one no trailer may carry (framing, routing, authentication: RFC
// 9110, 6.5.1), nor one the edge vouches for (Forwarded, X-Forwarded-*,
// X-Real-Ip). Both the edge and the agent apply it.

// PassTrailers makes out, a reverse proxy's outgoing request for in, carry
// in's declared trailers that may be trailers. Their values are copied when
// in's body ends: the transport writes the trailers after it has read the
// body to its end.
func PassTrailers(out, in *http.Request) {
	var declared http.Header
	for k := range in.Trailer {
		if TrailerAllowed(k) {
			if declared == nil {
				declared = http.Header{}
			}
			declared[k] = nil
		}
	}
	out.Trailer = declared
	if declared != nil && out.Body != nil && out.Body != http.NoBody {
		out.Body = &trailerBody{ReadCloser: out.Body, from: in, to: declared}
	}
}

// TrailerAllowed reports whether a field named k may cross as a trailer.
func TrailerAllowed(k string) bool {
	k = http.CanonicalHeaderKey(k)
	return httpguts.ValidTrailerHeader(k) && !ForwardingField(k)
}

// XForwarded are the fields the edge sets from what it saw of the visitor
// (httputil.ProxyRequest.SetXForwarded's): the reverse proxy on each hop
// drops them from what it sends, and the next hop passes the edge's on.
var XForwarded = []string{"X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto"}

// ForwardingField reports whether a field named k says where a request
// came from: Forwarded, X-Forwarded-*, X-Real-Ip and Ngstone-*, also
// spelled with '_' for '-' (which CGI-style servers read as the same
// name). The edge sets the ones it vouches for and drops the rest.
func ForwardingField(k string) bool {
	k = strings.ToLower(strings.ReplaceAll(k, "_", "-"))
	return k == "forwarded" || k == "x-real-ip" || strings.HasPrefix(k, "x-forwarded-") || strings.HasPrefix(k, "ngstone-")
}

// trailerBody copies the declared trailers' values when the body ends.
type trailerBody struct {
	io.ReadCloser
	from *http.Request
	to   http.Header
}

func (b *trailerBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		for k := range b.to {
			b.to[k] = b.from.Trailer[k]
		}
	}
	return n, err
}

// FilterTrailers drops the trailers of resp that may not cross
// (TrailerAllowed): those it declares at once, and those that arrive at the
// end of its body, which the reverse proxy passes on whether declared or
// not.
func FilterTrailers(resp *http.Response) {
	dropTrailers(resp.Trailer)
	if resp.Body == nil || resp.Body == http.NoBody || resp.StatusCode == http.StatusSwitchingProtocols {
		return // an upgraded connection's body is the connection itself
	}
	resp.Body = &filteredTrailers{ReadCloser: resp.Body, resp: resp}
}

func dropTrailers(h http.Header) {
	for k := range h {
		if !TrailerAllowed(k) {
			delete(h, k)
		}
	}
}

type filteredTrailers struct {
	io.ReadCloser
	resp *http.Response
}

func (b *filteredTrailers) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		dropTrailers(b.resp.Trailer)
	}
	return n, err
}
