package edge

import (
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"

	"github.com/ngstone/ngstone/mux"
)

// visitorAccess is who may reach one binding: the agent's --allow-cidr and
// --deny-cidr, sent with its bind. The edge applies it before a request
// crosses the tunnel; nil lets every visitor in.
type visitorAccess struct {
	allow, deny []netip.Prefix
	webhook     *webhookCheck // --verify-webhook; nil: none
	oauth       *oauthRule    // --oauth; nil: none
}

// parseAccess reads a bind's prefixes and webhook check; none at all is nil.
func parseAccess(allow, deny []string, webhook *mux.Webhook) (*visitorAccess, error) {
	wh, err := parseWebhook(webhook)
	if err != nil {
		return nil, err
	}
	if len(allow) == 0 && len(deny) == 0 && wh == nil {
		return nil, nil
	}
	const maxPrefixes = 1024
	if len(allow)+len(deny) > maxPrefixes {
		return nil, fmt.Errorf("at most %d --allow-cidr and --deny-cidr prefixes", maxPrefixes)
	}
	a := &visitorAccess{webhook: wh}
	for _, list := range []struct {
		flag string
		in   []string
		out  *[]netip.Prefix
	}{{"allow-cidr", allow, &a.allow}, {"deny-cidr", deny, &a.deny}} {
		for _, s := range list.in {
			p, err := mux.ParsePrefix(s)
			if err != nil {
				return nil, fmt.Errorf("%s %q: %w", list.flag, s, err)
			}
			*list.out = append(*list.out, p)
		}
	}
	return a, nil
}

// allows reports whether a visitor at ip may reach the binding: in no
// deny prefix, and in an allow prefix when there are any.
func (a *visitorAccess) allows(ip netip.Addr) bool {
	if a == nil {
		return true
	}
	// Judged by the address alone: netip matches no prefix for an
	// IPv4-mapped form or a zoned (link-local) one, which would let such
	// a visitor past a deny prefix.
	ip = ip.Unmap().WithZone("")
	for _, p := range a.deny {
		if p.Contains(ip) {
			return false
		}
	}
	if len(a.allow) == 0 {
		return true
	}
	for _, p := range a.allow {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// same reports whether a and b let in the same visitors by the same
// checks, secrets and allow lists included (String shows neither): a
// request checked against one may go to the other (a pool's retry).
func (a *visitorAccess) same(b *visitorAccess) bool {
	var x, y visitorAccess
	if a != nil {
		x = *a
	}
	if b != nil {
		y = *b
	}
	return slices.Equal(x.allow, y.allow) && slices.Equal(x.deny, y.deny) &&
		x.webhook.same(y.webhook) && x.oauth.same(y.oauth)
}

func (a *visitorAccess) String() string {
	if a == nil {
		return "any"
	}
	var b strings.Builder
	for _, p := range a.allow {
		fmt.Fprintf(&b, "+%s ", p)
	}
	for _, p := range a.deny {
		fmt.Fprintf(&b, "-%s ", p)
	}
	if a.webhook != nil {
		b.WriteString(a.webhook.String() + " ")
	}
	if a.oauth != nil {
		b.WriteString(a.oauth.String())
	}
	return strings.TrimSpace(b.String())
}

// visitorIP is the address of the visitor r came from: the connection's
// (which PROXY protocol may have set), or for a request another edge of the
// cluster forwarded, the one that edge saw.
func visitorIP(r *http.Request, forwarded bool) (netip.Addr, bool) {
	s := hostOf(r.RemoteAddr)
	if forwarded {
		s = strings.TrimSpace(r.Header.Get("X-Forwarded-For"))
	}
	ip, err := netip.ParseAddr(s)
	return ip, err == nil
}
