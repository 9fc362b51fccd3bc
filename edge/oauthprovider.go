package edge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"golang.org/x/oauth2"
	"golang.org/x/oauth2/github"

	"github.com/ngstone/ngstone/mux"
)

// OAuthProvider is a sign-in provider the operator offers agents
// (--oauth-provider NAME, its settings in the config file). Kind "oidc"
// discovers Issuer's endpoints; "google" is OIDC at Google's issuer;
// "github" is GitHub's OAuth2 with its emails API, at AuthURL, TokenURL
// and APIURL when set (GitHub Enterprise), else github.com's.
type OAuthProvider struct {
	Name         string
	Kind         string
	Issuer       string
	ClientID     string
	ClientSecret string `json:"-"`
	Scopes       []string
	AuthURL      string
	TokenURL     string
	APIURL       string
}

// OAuth provider kinds (OAuthProvider.Kind).
const (
	OAuthOIDC   = "oidc"
	OAuthGoogle = "google"
	OAuthGitHub = "github"
)

const googleIssuer = "https://accounts.google.com"

// providerTimeout bounds each call to a provider: discovery, the code's
// exchange, the user's emails.
const providerTimeout = 10 * time.Second

// maxProviderBody bounds what the edge reads of a provider's API answer.
const maxProviderBody = 1 << 20

func (p OAuthProvider) validate() error {
	switch {
	case !mux.ValidProviderName(p.Name):
		return fmt.Errorf("oauth-provider %q: a name is 1 to 63 of a-z 0-9 - _", p.Name)
	case p.ClientID == "" || p.ClientSecret == "":
		return fmt.Errorf("oauth-provider %s: client_id and client_secret_file are required", p.Name)
	case p.Kind == OAuthOIDC && p.Issuer == "":
		return fmt.Errorf("oauth-provider %s: an OIDC provider needs its issuer", p.Name)
	case p.Kind != OAuthOIDC && p.Kind != OAuthGoogle && p.Kind != OAuthGitHub:
		return fmt.Errorf("oauth-provider %s: kind %q: want oidc, google or github", p.Name, p.Kind)
	}
	return nil
}

// provider is an OAuthProvider in use. An OIDC issuer's endpoints are
// discovered at the first sign-in, and again after a failed discovery:
// an issuer down when the edge starts does not keep it from starting.
type provider struct {
	cfg    OAuthProvider
	client *http.Client

	mu       sync.Mutex
	oidc     *oidc.Provider
	verifier *oidc.IDTokenVerifier
	failed   time.Time // the last failed discovery
	err      error
}

// rediscover is how long a failed discovery is answered as failed, so
// that visitors of an issuer that is down do not each wait providerTimeout.
const rediscover = 5 * time.Second

func newProvider(cfg OAuthProvider) *provider {
	if cfg.Kind == OAuthGoogle && cfg.Issuer == "" {
		cfg.Issuer = googleIssuer
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	return &provider{cfg: cfg, client: &http.Client{Timeout: providerTimeout, Transport: tr}}
}

func (p *provider) ctx(ctx context.Context) context.Context {
	ctx = context.WithValue(ctx, oauth2.HTTPClient, p.client)
	return oidc.ClientContext(ctx, p.client)
}

// config is the provider's OAuth2 client, redirecting to redirectURL.
func (p *provider) config(ctx context.Context, redirectURL string) (*oauth2.Config, error) {
	c := &oauth2.Config{ClientID: p.cfg.ClientID, ClientSecret: p.cfg.ClientSecret, RedirectURL: redirectURL, Scopes: p.cfg.Scopes}
	if p.cfg.Kind == OAuthGitHub {
		c.Endpoint = github.Endpoint
		if p.cfg.AuthURL != "" {
			c.Endpoint = oauth2.Endpoint{AuthURL: p.cfg.AuthURL, TokenURL: p.cfg.TokenURL}
		}
		if len(c.Scopes) == 0 {
			c.Scopes = []string{"read:user", "user:email"}
		}
		return c, nil
	}
	op, err := p.discover(ctx)
	if err != nil {
		return nil, err
	}
	c.Endpoint = op.Endpoint()
	if len(c.Scopes) == 0 {
		c.Scopes = []string{oidc.ScopeOpenID, "email", "profile"}
	}
	return c, nil
}

func (p *provider) discover(ctx context.Context) (*oidc.Provider, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.oidc != nil {
		return p.oidc, nil
	}
	if time.Since(p.failed) < rediscover {
		return nil, p.err
	}
	// Not the visitor's to cancel: its answer serves the next ones too.
	ctx, cancel := context.WithTimeout(p.ctx(context.WithoutCancel(ctx)), providerTimeout)
	defer cancel()
	op, err := oidc.NewProvider(ctx, p.cfg.Issuer)
	if err != nil {
		p.failed, p.err = time.Now(), fmt.Errorf("discovery at %s: %w", p.cfg.Issuer, err)
		return nil, p.err
	}
	p.oidc, p.verifier = op, op.Verifier(&oidc.Config{ClientID: p.cfg.ClientID})
	return op, nil
}

// identity is who signed in: an address the provider verified (or none),
// the provider's subject, and the claims a tunnel's allow list names.
type identity struct {
	Email   string              `json:"e,omitempty"`
	Subject string              `json:"u"`
	Claims  map[string][]string `json:"c,omitempty"`
}

// exchange trades the provider's code for who signed in; keep names the
// claims the tunnel's allow list matches.
func (p *provider) exchange(ctx context.Context, c *oauth2.Config, code, verifier, nonce string, keep []string) (identity, error) {
	ctx, cancel := context.WithTimeout(p.ctx(ctx), providerTimeout)
	defer cancel()
	tok, err := c.Exchange(ctx, code, oauth2.VerifierOption(verifier))
	if err != nil {
		return identity{}, fmt.Errorf("the code's exchange: %w", err)
	}
	if p.cfg.Kind == OAuthGitHub {
		return p.github(ctx, c, tok)
	}
	raw, _ := tok.Extra("id_token").(string)
	if raw == "" {
		return identity{}, errors.New("the provider sent no ID token")
	}
	idt, err := p.verifier.Verify(ctx, raw)
	if err != nil {
		return identity{}, fmt.Errorf("the ID token: %w", err)
	}
	if idt.Nonce != nonce {
		return identity{}, errors.New("the ID token's nonce is not this sign-in's")
	}
	var claims map[string]any
	if err := idt.Claims(&claims); err != nil {
		return identity{}, fmt.Errorf("the ID token's claims: %w", err)
	}
	if _, ok := claims["email"]; !ok {
		// Some issuers put the address only in their userinfo.
		if ui, err := p.oidc.UserInfo(ctx, c.TokenSource(ctx, tok)); err == nil {
			var more map[string]any
			if ui.Claims(&more) == nil {
				for k, v := range more {
					if _, ok := claims[k]; !ok {
						claims[k] = v
					}
				}
			}
		}
	}
	id := identity{Subject: idt.Subject, Claims: map[string][]string{}}
	// An address counts only if the issuer says it verified it (some
	// send the string): one it does not vouch for may be anyone's.
	if email, _ := claims["email"].(string); email != "" && (claims["email_verified"] == true || claims["email_verified"] == "true") {
		id.Email = email
	}
	for _, k := range keep {
		if v := claimValues(claims[k]); len(v) > 0 {
			id.Claims[k] = v
		}
	}
	return id, nil
}

// claimValues is a claim as strings: a list's items, or the value.
func claimValues(v any) []string {
	switch v := v.(type) {
	case nil:
		return nil
	case string:
		return []string{v}
	case []any:
		var out []string
		for _, x := range v {
			out = append(out, claimValues(x)...)
		}
		return out
	case float64:
		return []string{strconv.FormatFloat(v, 'f', -1, 64)}
	default:
		return []string{fmt.Sprint(v)}
	}
}

// github reads who signed in from GitHub's API: the user's id, and the
// primary address GitHub verified.
func (p *provider) github(ctx context.Context, c *oauth2.Config, tok *oauth2.Token) (identity, error) {
	api := strings.TrimSuffix(p.cfg.APIURL, "/")
	if api == "" {
		api = "https://api.github.com"
	}
	hc := c.Client(ctx, tok)
	var user struct {
		ID int64 `json:"id"`
	}
	if err := getJSON(ctx, hc, api+"/user", &user); err != nil {
		return identity{}, err
	}
	var emails []struct {
		Email    string `json:"email"`
		Primary  bool   `json:"primary"`
		Verified bool   `json:"verified"`
	}
	if err := getJSON(ctx, hc, api+"/user/emails", &emails); err != nil {
		return identity{}, err
	}
	id := identity{Subject: strconv.FormatInt(user.ID, 10)}
	for _, e := range emails {
		if e.Primary && e.Verified {
			id.Email = e.Email
		}
	}
	if user.ID == 0 {
		return identity{}, errors.New("GitHub's /user has no id")
	}
	return id, nil
}

func getJSON(ctx context.Context, hc *http.Client, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/vnd.github+json")
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxProviderBody)).Decode(v); err != nil {
		return fmt.Errorf("%s: %w", url, err)
	}
	return nil
}
