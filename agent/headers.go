package agent

import (
	"fmt"
	"io"
	"net/http"
	"strings"

	"golang.org/x/net/http/httpguts"

	"github.com/ngstone/ngstone/mux"
)

// headerRules are the --request-header-* and --response-header-* rules.
type headerRules struct {
	reqAdd, respAdd     [][2]string // canonical name, value
	reqDel, respDel     []string    // canonical names
	reqRuled, respRuled []string    // every name a rule of each side sets or removes
}

// framingFields describe how a message is carried, not what it says: no
// rule may touch them.
var framingFields = map[string]bool{
	"Host": true, "Content-Length": true, "Transfer-Encoding": true, "Connection": true,
	"Keep-Alive": true, "Te": true, "Trailer": true, "Upgrade": true, "Proxy-Connection": true,
}

// parseHeaderRules reads and checks c's header rules.
func parseHeaderRules(c Tunnel) (*headerRules, error) {
	r := &headerRules{}
	check := func(flag, name string) (string, error) {
		k := http.CanonicalHeaderKey(strings.TrimSpace(name))
		switch {
		case !httpguts.ValidHeaderFieldName(k):
			return "", fmt.Errorf("%s %q: not a header field name", flag, name)
		case mux.ForwardingField(k):
			return "", fmt.Errorf("%s %s: the edge sets or drops the fields about the visitor (X-Forwarded-*, Forwarded, X-Real-Ip) and its own (Ngstone-*); no rule may change them", flag, k)
		case framingFields[http.CanonicalHeaderKey(strings.ReplaceAll(k, "_", "-"))]:
			return "", fmt.Errorf("%s %s: a field of the message's framing; no rule may change it", flag, k)
		}
		return k, nil
	}
	adds := func(flag string, in []string, out *[][2]string) error {
		for _, kv := range in {
			name, value, ok := strings.Cut(kv, ":")
			if !ok {
				return fmt.Errorf("%s %q: want Name: value", flag, kv)
			}
			k, err := check(flag, name)
			if err != nil {
				return err
			}
			value = strings.TrimSpace(value)
			if !httpguts.ValidHeaderFieldValue(value) {
				return fmt.Errorf("%s %q: the value holds bytes a header may not", flag, kv)
			}
			*out = append(*out, [2]string{k, value})
		}
		return nil
	}
	dels := func(flag string, in []string, out *[]string) error {
		for _, name := range in {
			k, err := check(flag, name)
			if err != nil {
				return err
			}
			*out = append(*out, k)
		}
		return nil
	}
	for _, err := range []error{
		adds("request-header-add", c.RequestHeaderAdd, &r.reqAdd), dels("request-header-remove", c.RequestHeaderRemove, &r.reqDel),
		adds("response-header-add", c.ResponseHeaderAdd, &r.respAdd), dels("response-header-remove", c.ResponseHeaderRemove, &r.respDel),
	} {
		if err != nil {
			return nil, err
		}
	}
	if len(r.reqAdd)+len(r.reqDel)+len(r.respAdd)+len(r.respDel) == 0 {
		return nil, nil
	}
	r.reqRuled, r.respRuled = ruled(r.reqDel, r.reqAdd), ruled(r.respDel, r.respAdd)
	return r, nil
}

func ruled(del []string, add [][2]string) []string {
	out := append([]string(nil), del...)
	for _, kv := range add {
		out = append(out, kv[0])
	}
	return out
}

// request applies the request rules to out, the request to the local
// service: to its head, and to the trailers it declares (mux.PassTrailers
// copies only those), so that a field a rule sets or removes does not
// arrive as a trailer either.
func (r *headerRules) request(out *http.Request) {
	if r == nil {
		return
	}
	apply(out.Header, r.reqRuled, r.reqAdd)
	dropRuled(out.Trailer, r.reqRuled)
}

// response applies the response rules to resp: to its head, to the
// trailers it declares, and to those that arrive after its body (the
// reverse proxy passes those on, declared or not). An upgrade's body is the
// connection itself, and is left alone.
func (r *headerRules) response(resp *http.Response) {
	if r == nil {
		return
	}
	apply(resp.Header, r.respRuled, r.respAdd)
	dropRuled(resp.Trailer, r.respRuled)
	if resp.Body != nil && resp.Body != http.NoBody && resp.StatusCode != http.StatusSwitchingProtocols {
		resp.Body = &ruledTrailers{ReadCloser: resp.Body, resp: resp, ruled: r.respRuled}
	}
}

// apply removes the fields the rules name (ruled: those removed and those
// added), then sets those add gives: a field a rule adds replaces any of
// that name already there (the visitor's, for a request), so that the
// local service can trust what a rule set; rules for one name add a value
// each.
func apply(h http.Header, ruled []string, add [][2]string) {
	dropRuled(h, ruled)
	for _, kv := range add {
		h.Add(kv[0], kv[1])
	}
}

// dropRuled drops from h every field named as one of ruled, in any
// spelling sameField takes for it.
func dropRuled(h http.Header, ruled []string) {
	for k := range h {
		for _, n := range ruled {
			if sameField(k, n) {
				delete(h, k)
				break
			}
		}
	}
}

// sameField reports whether field names a and b are one name to a CGI or
// WSGI server, which reads both as HTTP_ and the name upper-cased with '_'
// for '-' (X_Team is X-Team there): equal but for case and '_' against '-'.
func sameField(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		if foldField(a[i]) != foldField(b[i]) {
			return false
		}
	}
	return true
}

func foldField(c byte) byte {
	switch {
	case c == '_':
		return '-'
	case 'A' <= c && c <= 'Z':
		return c + 'a' - 'A'
	}
	return c
}

// ruledTrailers is a response body that drops the response rules' fields
// from the trailers that came after it, once it ends.
type ruledTrailers struct {
	io.ReadCloser
	resp  *http.Response
	ruled []string
}

func (b *ruledTrailers) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		dropRuled(b.resp.Trailer, b.ruled)
	}
	return n, err
}
