package edge

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"golang.org/x/oauth2"

	"github.com/ngstone/ngstone/mux"
)

// Sign-in at the edge. A tunnel bound with OAuth lets in only visitors
// with a session cookie on its own host. Without one, a browser is sent to
// the provider, whose answer lands on the edge's callback host (auth.DOMAIN,
// the one address registered at each provider); the callback hands the
// session to the tunnel's host by a sealed code that lives a minute and is
// good only with the state cookie set on that host when the sign-in began.
// Every value the browser keeps is sealed (seal.go); the edge keeps nothing
// per visitor but the nonces already used.

// Paths the edge answers itself on a tunnel with OAuth, and on auth.DOMAIN.
const (
	oauthCallbackPath = "/.ngstone/oauth/callback"
	oauthLogoutPath   = "/.ngstone/logout"
	// oauthHost is the callback host's name under the domain, reserved.
	oauthHost = "auth"
)

// Cookies: __Host- binds each to the host that set it, over HTTPS. A
// sign-in's state cookie is named after its nonce, so that sign-ins begun
// at once in one browser (tabs restored together) each finish.
const (
	sessionCookie = "__Host-ngstone-session"
	statePrefix   = "__Host-ngstone-state"
)

// Fields the local service receives about who signed in; the edge drops
// any a visitor sent (mux.ForwardingField).
const (
	HeaderAuthEmail   = "Ngstone-Auth-Email"
	HeaderAuthSubject = "Ngstone-Auth-Subject"
)

const (
	// stateLifetime bounds a sign-in at the provider.
	stateLifetime = 10 * time.Minute
	// handoffLifetime bounds the hop from the callback to the tunnel.
	handoffLifetime = time.Minute
	// usedNonces bounds the nonces an edge remembers, each until it
	// expires (at most stateLifetime): full, it refuses new sign-ins
	// rather than forget one in force, which could then be used again.
	usedNonces = 1 << 16
	// maxCookie bounds the session cookie's value, within a browser's 4 KiB.
	maxCookie = 3800
	// maxReturnPath bounds the path a sign-in returns to, sealed in the
	// state and the handoff (each read up to maxSealed).
	maxReturnPath = 1024
	// maxStates bounds the sign-ins a browser has under way on one host:
	// a new one past it drops the state cookies of those begun first.
	maxStates = 4
)

// Sealed kinds.
const (
	sealSession = "ngstone session v1"
	sealState   = "ngstone state v1"
	sealHandoff = "ngstone handoff v1"
)

// oauthRule is a tunnel's OAuth: its provider and allow lists.
type oauthRule struct {
	provider  *provider
	emails    []string // lower case
	domains   []string // lower case, no leading @
	claims    map[string][]string
	preflight bool
}

// session is what the session cookie holds.
type oauthSession struct {
	Host     string `json:"h"`
	Provider string `json:"p"`
	identity
	Issued int64 `json:"i"` // Unix seconds
	Seen   int64 `json:"s"`
}

// oauthState travels through the provider as the state parameter.
type oauthState struct {
	Origin   string   `json:"o"` // https://HOST[:PORT] of the tunnel
	Host     string   `json:"h"`
	Path     string   `json:"r"`
	Provider string   `json:"p"`
	Verifier string   `json:"v"`
	Nonce    string   `json:"n"`
	Claims   []string `json:"c,omitempty"`
	Expires  int64    `json:"x"`
}

// oauthHandoff carries a session from the callback to the tunnel's host.
type oauthHandoff struct {
	Nonce   string       `json:"n"`
	Path    string       `json:"r"`
	Session oauthSession `json:"s"`
	Expires int64        `json:"x"`
}

// oauth is an edge's sign-in: its providers, its key, the nonces used.
type oauth struct {
	providers map[string]*provider
	seal      *sealer
	lifetime  time.Duration
	idle      time.Duration

	mu      sync.Mutex
	used    map[string]int64    // nonce → when it expires (Unix seconds)
	pending map[string]struct{} // nonces whose sign-in the provider is being asked about
	// soonest is no later than when the first of used expires: full
	// until then, a sign-in is refused without a sweep.
	soonest int64
}

func newOAuth(cfg Config) (*oauth, error) {
	if len(cfg.OAuthProviders) == 0 {
		return nil, nil
	}
	key := cfg.OAuthKey
	if key == nil {
		var clusterKey string
		if cfg.Cluster != nil {
			clusterKey = cfg.Cluster.Key
		}
		var err error
		if key, err = sealKey(clusterKey, cfg.TLS.DataDir); err != nil {
			return nil, fmt.Errorf("oauth key: %w", err)
		}
	}
	s, err := newSealer(key)
	if err != nil {
		return nil, err
	}
	o := &oauth{providers: map[string]*provider{}, seal: s, lifetime: cfg.OAuthSessionDuration, idle: cfg.OAuthIdleTimeout, used: map[string]int64{}, pending: map[string]struct{}{}}
	for _, p := range cfg.OAuthProviders {
		o.providers[p.Name] = newProvider(p)
	}
	return o, nil
}

// close drops the providers' idle connections.
func (o *oauth) close() {
	if o == nil {
		return
	}
	for _, p := range o.providers {
		p.client.CloseIdleConnections()
	}
}

// rule reads a bind's OAuth; none is nil.
func (o *oauth) rule(m *mux.OAuth) (*oauthRule, error) {
	if m == nil {
		return nil, nil
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	var p *provider
	if o != nil {
		p = o.providers[m.Provider]
	}
	if p == nil {
		return nil, fmt.Errorf("oauth %q: this edge offers %s", m.Provider, o.names())
	}
	r := &oauthRule{provider: p, claims: map[string][]string{}, preflight: m.AllowPreflight}
	for _, e := range m.AllowEmails {
		r.emails = append(r.emails, strings.ToLower(e))
	}
	for _, d := range m.AllowDomains {
		r.domains = append(r.domains, strings.ToLower(strings.TrimPrefix(d, "@")))
	}
	for _, c := range m.AllowClaims {
		k, v, _ := strings.Cut(c, "=")
		r.claims[k] = append(r.claims[k], v)
	}
	return r, nil
}

func (o *oauth) names() string {
	if o == nil || len(o.providers) == 0 {
		return "no sign-in provider (its operator sets --oauth-provider)"
	}
	var names []string
	for n := range o.providers {
		names = append(names, n)
	}
	slices.Sort(names)
	return strings.Join(names, ", ")
}

// same reports whether r and q let in the same visitors; nil is no rule.
func (r *oauthRule) same(q *oauthRule) bool {
	if r == nil || q == nil {
		return r == q
	}
	return r.provider == q.provider && r.preflight == q.preflight && slices.Equal(r.emails, q.emails) &&
		slices.Equal(r.domains, q.domains) && maps.EqualFunc(r.claims, q.claims, slices.Equal)
}

func (r *oauthRule) String() string {
	return "oauth=" + r.provider.cfg.Name
}

// allows reports whether id may visit.
func (r *oauthRule) allows(id identity) bool {
	if len(r.emails) == 0 && len(r.domains) == 0 && len(r.claims) == 0 {
		return true
	}
	if email := strings.ToLower(id.Email); email != "" {
		if slices.Contains(r.emails, email) {
			return true
		}
		if _, domain, _ := strings.Cut(email, "@"); slices.Contains(r.domains, domain) {
			return true
		}
	}
	for k, want := range r.claims {
		for _, v := range id.Claims[k] {
			if slices.Contains(want, v) {
				return true
			}
		}
	}
	return false
}

// claimNames are the claims the rule matches, to keep in the session.
func (r *oauthRule) claimNames() []string {
	var names []string
	for k := range r.claims {
		names = append(names, k)
	}
	slices.Sort(names)
	return names
}

type identityKey struct{}

// signedIn gates a request for a tunnel with rule: it returns the request
// to pass on (the edge's cookies removed, who signed in in its context), or
// answers the visitor itself and returns nil.
func (e *Edge) signedIn(w http.ResponseWriter, r *http.Request, rt route, rule *oauthRule) *http.Request {
	o, now := e.oauth, time.Now()
	host := rt.hostname
	states := stateCookies(r)
	sess, sessErr := o.session(r, host, rule, now)
	dropCookies(r.Header, edgeCookie)
	if strings.Contains(r.Header.Get("Referer"), oauthCallbackPath) {
		r.Header.Del("Referer") // it would carry the handoff's code on
	}
	switch r.URL.Path {
	case oauthCallbackPath:
		e.oauthHandoff(w, r, host, states, now)
		return nil
	case oauthLogoutPath:
		e.oauthLogout(w, r, host)
		return nil
	}
	if rule.preflight && r.Method == http.MethodOptions && r.Header.Get("Origin") != "" && r.Header.Get("Access-Control-Request-Method") != "" {
		return r
	}
	if sessErr != nil {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			e.metrics.oauth.WithLabelValues(rule.provider.cfg.Name, "required").Inc()
			mux.WriteVisitorErrorFor(w, r, mux.CodeOAuthRequired, host)
			return nil
		}
		e.oauthStart(w, r, rt, rule, states, now)
		return nil
	}
	if !rule.allows(sess.identity) {
		e.metrics.oauth.WithLabelValues(rule.provider.cfg.Name, "denied").Inc()
		who := sess.Email
		if who == "" {
			who = rule.provider.cfg.Name + " user " + sess.Subject
		}
		rt.s.tellRefused(&mux.Refused{Hostname: host, Method: r.Method, Path: r.URL.RequestURI(), Code: mux.CodeOAuthDenied, Reason: "signed in as " + who})
		e.oauthPage(w, http.StatusForbidden, mux.CodeOAuthDenied, "Not allowed", host, who,
			host+" lets in only the visitors its owner allows, and "+who+" is not one of them.", oauthLogoutPath)
		return nil
	}
	if now.Unix()-sess.Seen >= int64(o.idle/time.Second)/8 {
		// Seen again: the idle timeout counts from now.
		sess.Seen = now.Unix()
		if v, err := o.seal.seal(sealSession, sess); err == nil {
			setCookie(w, sessionCookie, v, time.Unix(sess.Issued, 0).Add(o.lifetime).Sub(now))
		}
	}
	return r.WithContext(context.WithValue(r.Context(), identityKey{}, &sess.identity))
}

// session is the visitor's valid session for host, or why there is none.
func (o *oauth) session(r *http.Request, host string, rule *oauthRule, now time.Time) (oauthSession, error) {
	var s oauthSession
	v := cookieValue(r, sessionCookie)
	if v == "" {
		return s, errors.New("no session")
	}
	if err := o.seal.open(sealSession, v, &s); err != nil {
		return s, err
	}
	switch {
	case s.Host != host:
		return s, errors.New("a session of another host")
	case s.Provider != rule.provider.cfg.Name:
		return s, errors.New("a session of another provider")
	case now.After(time.Unix(s.Issued, 0).Add(o.lifetime)):
		return s, errors.New("the session is over its lifetime")
	case now.After(time.Unix(s.Seen, 0).Add(o.idle)):
		return s, errors.New("the session was idle too long")
	}
	return s, nil
}

// oauthStart sends the visitor to the provider to sign in; states are the
// sign-ins its browser has under way here.
func (e *Edge) oauthStart(w http.ResponseWriter, r *http.Request, rt route, rule *oauthRule, states []*http.Cookie, now time.Time) {
	o, p := e.oauth, rule.provider
	if !e.visitorTLS(r, rt) {
		// The session cookie is Secure: sign in over HTTPS.
		http.Redirect(w, r, "https://"+rt.hostname+e.httpsPort()+r.URL.RequestURI(), http.StatusFound)
		return
	}
	port := hostPort(r.Host)
	c, err := p.config(r.Context(), "https://"+oauthHost+"."+e.cfg.Domain+port+oauthCallbackPath)
	if err != nil {
		e.oauthFailed(w, r, rt.hostname, p.cfg.Name, http.StatusBadGateway, "the provider "+p.cfg.Name+" could not be reached", err)
		return
	}
	path := r.URL.RequestURI()
	if len(path) > maxReturnPath {
		path = "/" // the state and the handoff stay within maxSealed
	}
	st := oauthState{
		Origin: "https://" + rt.hostname + port, Host: rt.hostname, Path: path, Provider: p.cfg.Name,
		Verifier: oauth2.GenerateVerifier(), Nonce: randomToken(), Claims: rule.claimNames(), Expires: now.Add(stateLifetime).Unix(),
	}
	sealed, err := o.seal.seal(sealState, st)
	if err != nil {
		e.oauthFailed(w, r, rt.hostname, p.cfg.Name, http.StatusInternalServerError, "the edge could not start a sign-in", err)
		return
	}
	if n := len(states) - (maxStates - 1); n > 0 {
		// The value is when the sign-in expires: the oldest go first.
		slices.SortFunc(states, func(a, b *http.Cookie) int { return cmp.Compare(unixValue(a), unixValue(b)) })
		for _, c := range states[:n] {
			clearCookie(w, c.Name)
		}
	}
	setCookie(w, stateName(st.Nonce), strconv.FormatInt(st.Expires, 10), stateLifetime)
	opts := []oauth2.AuthCodeOption{oauth2.S256ChallengeOption(st.Verifier)}
	if p.cfg.Kind != OAuthGitHub {
		opts = append(opts, oidc.Nonce(st.Nonce))
	}
	w.Header().Set("Cache-Control", "no-store")
	http.Redirect(w, r, c.AuthCodeURL(sealed, opts...), http.StatusFound)
}

// oauthCallback serves auth.DOMAIN: the provider's answer, traded for who
// signed in and handed to the tunnel's host.
func (e *Edge) oauthCallback(w http.ResponseWriter, r *http.Request) {
	host, now := r.Host, time.Now()
	if r.URL.Path != oauthCallbackPath || r.Method != http.MethodGet {
		mux.WriteVisitorErrorFor(w, r, mux.CodeTunnelNotFound, host)
		return
	}
	o := e.oauth
	var st oauthState
	q := r.URL.Query()
	if err := o.seal.open(sealState, q.Get("state"), &st); err != nil {
		e.oauthFailed(w, r, host, "", http.StatusBadRequest, "this sign-in's state is not one this edge made", err)
		return
	}
	host = st.Host
	p := o.providers[st.Provider]
	switch {
	case p == nil:
		e.oauthFailed(w, r, host, st.Provider, http.StatusBadRequest, "the provider "+st.Provider+" is no longer offered", nil)
		return
	case now.Unix() > st.Expires:
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusBadRequest, "the sign-in took too long", nil)
		return
	case q.Get("error") != "":
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusForbidden, "the provider said: "+q.Get("error")+" "+q.Get("error_description"), nil)
		return
	}
	const usedAlready = "this sign-in's answer was used already"
	switch o.begin(st.Nonce) {
	case beginUsed:
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusBadRequest, usedAlready, nil)
		return
	case beginFull:
		e.metrics.limited(limitSignIns)
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusServiceUnavailable,
			fmt.Sprintf("the edge is asking its providers about %d sign-ins already: retry in a moment", maxPending), nil)
		return
	}
	defer o.end(st.Nonce)
	c, err := p.config(r.Context(), "https://"+oauthHost+"."+e.cfg.Domain+hostPort(r.Host)+oauthCallbackPath)
	if err != nil {
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusBadGateway, "the provider "+p.cfg.Name+" could not be reached", err)
		return
	}
	id, err := p.exchange(r.Context(), c, q.Get("code"), st.Verifier, st.Nonce, st.Claims)
	if err != nil {
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusBadGateway, "the provider "+p.cfg.Name+" did not confirm the sign-in", err)
		return
	}
	// Marked used only once the provider confirmed the sign-in: states
	// anyone may have (a tunnel's redirect hands them out) with no code
	// behind them take no room among the nonces.
	if !e.useNonce(w, r, host, p.cfg.Name, st.Nonce, st.Expires, now, usedAlready) {
		return
	}
	h := oauthHandoff{Nonce: st.Nonce, Path: st.Path, Expires: now.Add(handoffLifetime).Unix(),
		Session: oauthSession{Host: st.Host, Provider: p.cfg.Name, identity: id, Issued: now.Unix(), Seen: now.Unix()}}
	sealed, err := o.seal.seal(sealHandoff, h)
	if err != nil {
		e.oauthFailed(w, r, host, p.cfg.Name, http.StatusInternalServerError, "the edge could not finish the sign-in", err)
		return
	}
	e.metrics.oauth.WithLabelValues(p.cfg.Name, "signed_in").Inc()
	e.log.Info("visitor signed in", "hostname", st.Host, "provider", p.cfg.Name, "email", id.Email, "subject", id.Subject)
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Referrer-Policy", "no-referrer")
	http.Redirect(w, r, st.Origin+oauthCallbackPath+"?code="+sealed, http.StatusFound)
}

// oauthHandoff serves a tunnel's callback path: the session the callback
// sealed becomes the host's cookie, if the browser is the one that began
// the sign-in here (its state cookie, among states).
func (e *Edge) oauthHandoff(w http.ResponseWriter, r *http.Request, host string, states []*http.Cookie, now time.Time) {
	o := e.oauth
	var h oauthHandoff
	err := o.seal.open(sealHandoff, r.URL.Query().Get("code"), &h)
	switch {
	case err != nil:
	case h.Session.Host != host:
		err = errors.New("a sign-in of another host")
	case now.Unix() > h.Expires:
		err = errors.New("the handoff is over its lifetime")
	case !slices.ContainsFunc(states, func(c *http.Cookie) bool { return c.Name == stateName(h.Nonce) }):
		err = errors.New("this browser did not begin the sign-in here")
	}
	if err != nil {
		e.oauthFailed(w, r, host, h.Session.Provider, http.StatusBadRequest, "this sign-in cannot finish here", err)
		return
	}
	if !e.useNonce(w, r, host, h.Session.Provider, "handoff "+h.Nonce, h.Expires, now, "this sign-in cannot finish here: its handoff was used already") {
		return
	}
	v, err := o.seal.seal(sealSession, h.Session)
	if err == nil && len(v) > maxCookie {
		err = fmt.Errorf("the session is %d bytes, over a cookie's %d: the allow list names claims too large", len(v), maxCookie)
	}
	if err != nil {
		e.oauthFailed(w, r, host, h.Session.Provider, http.StatusInternalServerError, "the edge could not finish the sign-in", err)
		return
	}
	clearCookie(w, stateName(h.Nonce))
	setCookie(w, sessionCookie, v, o.lifetime)
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Referrer-Policy", "no-referrer")
	http.Redirect(w, r, localPath(h.Path), http.StatusSeeOther)
}

// useNonce marks nonce used until expires (Unix seconds), or answers the
// visitor why not: used already (400, saying used), or usedNonces in force
// already (503). It reports whether the sign-in goes on.
func (e *Edge) useNonce(w http.ResponseWriter, r *http.Request, host, provider, nonce string, expires int64, now time.Time, used string) bool {
	fresh, full := e.oauth.use(nonce, expires, now.Unix())
	switch {
	case full:
		e.metrics.limited(limitSignIns)
		e.oauthFailed(w, r, host, provider, http.StatusServiceUnavailable,
			fmt.Sprintf("the edge is finishing %d sign-ins already: retry in a few minutes", usedNonces), nil)
	case !fresh:
		e.oauthFailed(w, r, host, provider, http.StatusBadRequest, used, nil)
	}
	return fresh
}

// What begin says of a sign-in's answer.
const (
	beginOK   = iota // its nonce is pending until end
	beginUsed        // used already, or being checked with the provider
	beginFull        // maxPending are being checked already
)

// maxPending bounds the sign-ins the edge asks its providers about at once.
const maxPending = 4096

// begin marks nonce pending while the provider is asked about its sign-in,
// so that the same answer brought twice at once is asked about once; it
// is marked used (use) only once the provider confirmed it, so that
// answers with nothing behind them take no room among the used.
func (o *oauth) begin(nonce string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, used := o.used[nonce]
	_, pending := o.pending[nonce]
	switch {
	case used || pending:
		return beginUsed
	case len(o.pending) >= maxPending:
		return beginFull
	}
	o.pending[nonce] = struct{}{}
	return beginOK
}

// end ends nonce's pending.
func (o *oauth) end(nonce string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.pending, nonce)
}

// use marks nonce used until expires; fresh is false if it was already.
// Full, it forgets the expired nonces; full of nonces in force, it marks
// none (full).
func (o *oauth) use(nonce string, expires, now int64) (fresh, full bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.used[nonce]; ok {
		return false, false
	}
	if len(o.used) >= usedNonces {
		if now <= o.soonest {
			return false, true
		}
		o.soonest = math.MaxInt64
		maps.DeleteFunc(o.used, func(_ string, exp int64) bool {
			if exp < now {
				return true
			}
			o.soonest = min(o.soonest, exp)
			return false
		})
		if len(o.used) >= usedNonces {
			return false, true
		}
	}
	o.used[nonce] = expires
	o.soonest = min(o.soonest, expires)
	return true, false
}

// oauthFailed answers a sign-in that cannot go on: 400 oauth_failed for
// the visitor's side, the status given for the provider's or the edge's.
func (e *Edge) oauthFailed(w http.ResponseWriter, r *http.Request, host, provider string, status int, why string, err error) {
	attrs := []any{"hostname", host, "provider", provider, "reason", why}
	if err != nil {
		attrs = append(attrs, "err", err.Error())
	}
	e.log.Info("sign-in failed", attrs...)
	e.metrics.oauth.WithLabelValues(provider, "failed").Inc()
	e.oauthPage(w, status, mux.CodeOAuthFailed, "Sign-in failed", host, "", why+". Open "+host+" again to start over.", "")
}

// oauthLogout signs a visitor out of host: a GET shows a page whose
// button does it (a POST), and a POST from host's own page (or from no
// browser: no Origin) ends the session. Another site's page cannot sign
// a visitor out, by a link, an image or a form of its own; another
// tunnel of the edge is another site.
func (e *Edge) oauthLogout(w http.ResponseWriter, r *http.Request, host string) {
	switch {
	case r.Method != http.MethodPost:
		e.oauthForm(w, host)
	case !fromHost(r):
		e.oauthPage(w, http.StatusBadRequest, mux.CodeBadRequest, "Not signed out", host, "",
			"Another site asked to sign you out of "+host+": only its own page may. Sign out from "+host+oauthLogoutPath+".", "")
	default:
		clearCookie(w, sessionCookie)
		e.oauthPage(w, http.StatusOK, "", "Signed out", host, "", "You are signed out of "+host+".", "/")
	}
}

// fromHost reports whether r comes from a page of its own host, as a
// browser says (Sec-Fetch-Site; else Origin, which a page without a
// referrer sends as "null"), or from a client that says nothing of it.
func fromHost(r *http.Request) bool {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "same-origin":
		return true
	case "":
	default:
		return false
	}
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	u, err := url.Parse(o)
	// The scheme is left out: a request another edge forwarded came over
	// its TLS, whatever the visitor's was.
	return err == nil && u.Host != "" && strings.EqualFold(u.Host, r.Host)
}

var oauthPageTmpl = template.Must(template.New("").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{{.Title}} · {{.Host}}</title></head>
<body style="font-family:system-ui,sans-serif;max-width:36em;margin:4em auto;padding:0 1em">
<h1>{{.Title}}</h1><p id="text">{{.Text}}</p>
{{if .Who}}<p>Signed in as <b id="who">{{.Who}}</b>.</p>{{end}}
{{if .Link}}<p><a id="link" href="{{.Link}}">{{if .Who}}Sign out{{else}}Continue{{end}}</a></p>{{end}}
{{if .Form}}<form method="post" action="{{.Form}}"><button id="signout" type="submit">Sign out</button></form>{{end}}
{{if .Code}}<p><small>{{.Code}}</small></p>{{end}}
</body></html>
`))

// oauthForm is the sign-out page: its button posts to the logout path.
func (e *Edge) oauthForm(w http.ResponseWriter, host string) {
	e.writePage(w, http.StatusOK, "", pageData{Title: "Sign out", Host: host, Text: "Sign out of " + host + "?", Form: oauthLogoutPath})
}

type pageData struct{ Title, Host, Who, Text, Link, Form, Code string }

// oauthPage answers with one of the edge's sign-in pages.
func (e *Edge) oauthPage(w http.ResponseWriter, status int, code, title, host, who, text, link string) {
	e.writePage(w, status, code, pageData{Title: title, Host: host, Who: who, Text: text, Link: link, Code: code})
}

func (e *Edge) writePage(w http.ResponseWriter, status int, code string, d pageData) {
	h := w.Header()
	if code != "" {
		h.Set(mux.ErrorHeader, code)
	}
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
	if d.Form != "" {
		// So that a browser without Sec-Fetch-Site sends the form's Origin.
		h.Set("Referrer-Policy", "same-origin")
	} else {
		h.Set("Referrer-Policy", "no-referrer")
	}
	w.WriteHeader(status)
	oauthPageTmpl.Execute(w, d)
}

func setCookie(w http.ResponseWriter, name, value string, maxAge time.Duration) {
	http.SetCookie(w, &http.Cookie{Name: name, Value: value, Path: "/", MaxAge: max(int(maxAge/time.Second), 1),
		Secure: true, HttpOnly: true, SameSite: http.SameSiteLaxMode})
}

func clearCookie(w http.ResponseWriter, name string) {
	http.SetCookie(w, &http.Cookie{Name: name, Value: "", Path: "/", MaxAge: -1, Secure: true, HttpOnly: true, SameSite: http.SameSiteLaxMode})
}

// cookieValue is the first cookie called name; "" if none.
func cookieValue(r *http.Request, name string) string {
	if c, err := r.Cookie(name); err == nil {
		return c.Value
	}
	return ""
}

// stateName is the name of the state cookie of the sign-in with nonce.
func stateName(nonce string) string { return statePrefix + "-" + nonce }

// stateCookies are the state cookies r carries: the sign-ins its browser
// has under way on this host.
func stateCookies(r *http.Request) []*http.Cookie {
	var out []*http.Cookie
	for _, c := range r.Cookies() {
		if strings.HasPrefix(c.Name, statePrefix+"-") {
			out = append(out, c)
		}
	}
	return out
}

// unixValue is c's value as Unix seconds; 0 if it is not a number.
func unixValue(c *http.Cookie) int64 {
	n, _ := strconv.ParseInt(c.Value, 10, 64)
	return n
}

// edgeCookie reports whether a cookie called name is the edge's own: a
// session, or a state of any sign-in (or of the single one before).
func edgeCookie(name string) bool {
	return name == sessionCookie || strings.HasPrefix(name, statePrefix)
}

// dropCookies removes the cookies whose names drop reports from h's
// Cookie fields, leaving the others' bytes as they came.
func dropCookies(h http.Header, drop func(name string) bool) {
	vals := h["Cookie"]
	if len(vals) == 0 {
		return
	}
	var out []string
	for _, v := range vals {
		var kept []string
		for part := range strings.SplitSeq(v, ";") {
			name, _, _ := strings.Cut(strings.TrimSpace(part), "=")
			if !drop(strings.TrimSpace(name)) {
				kept = append(kept, strings.TrimSpace(part))
			}
		}
		if len(kept) > 0 {
			out = append(out, strings.Join(kept, "; "))
		}
	}
	if len(out) == 0 {
		delete(h, "Cookie")
		return
	}
	h["Cookie"] = out
}

// localPath is p if it is a path of this host, else "/": the handoff
// never redirects anywhere else.
func localPath(p string) string {
	if !strings.HasPrefix(p, "/") || strings.HasPrefix(p, "//") || strings.HasPrefix(p, "/\\") || !visibleASCII(p) {
		return "/"
	}
	return p
}

// hostPort is the ":PORT" of a Host field, or "".
func hostPort(hostField string) string {
	_, port, err := net.SplitHostPort(hostField)
	if n, perr := strconv.ParseUint(port, 10, 16); err != nil || perr != nil || n == 0 || n == 443 || port[0] == '0' {
		return ""
	}
	return ":" + port
}

// httpsPort is ":PORT" of the HTTPS listener, or "" for 443.
func (e *Edge) httpsPort() string {
	if a := e.Addr("https"); a != nil {
		return hostPort(a.String())
	}
	return ""
}

// visitorTLS reports whether the visitor came over HTTPS: this edge's
// connection, or for a forwarded request the first edge's.
func (e *Edge) visitorTLS(r *http.Request, rt route) bool {
	if rt.forwarded {
		return r.Header.Get("X-Forwarded-Proto") == "https"
	}
	return r.TLS != nil
}

func randomToken() string {
	b := make([]byte, 18)
	rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}
