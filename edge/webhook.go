package edge

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// Webhook verification: an agent's --verify-webhook has the edge check each
// request's signature, made with the tunnel's secret, before the request
// crosses the tunnel. The body is read whole, up to VerifyWebhookMaxBody,
// and passed on as read. Each provider's scheme is the one its docs give.

// webhookTolerance bounds the age of a signed timestamp (Stripe, Slack),
// as both providers' docs and libraries do.
const webhookTolerance = 5 * time.Minute

type webhookCheck struct {
	provider string
	header   string // hmac: the field that carries the signature
	secret   []byte
}

// parseWebhook reads a bind's webhook settings; none is nil.
func parseWebhook(w *mux.Webhook) (*webhookCheck, error) {
	if w == nil {
		return nil, nil
	}
	if err := w.Validate(); err != nil {
		return nil, err
	}
	return &webhookCheck{provider: w.Provider, header: http.CanonicalHeaderKey(w.Header), secret: []byte(w.Secret)}, nil
}

// same reports whether c and d check a request alike; nil is no check.
func (c *webhookCheck) same(d *webhookCheck) bool {
	if c == nil || d == nil {
		return c == d
	}
	return c.provider == d.provider && c.header == d.header && hmac.Equal(c.secret, d.secret)
}

func (c *webhookCheck) String() string {
	if c.provider == "hmac" {
		return "webhook=hmac:" + c.header
	}
	return "webhook=" + c.provider
}

// verify says why body, with header h, is not signed with c's secret, or
// returns nil.
func (c *webhookCheck) verify(h http.Header, body []byte, now time.Time) error {
	switch c.provider {
	case "github":
		sig, ok := strings.CutPrefix(h.Get("X-Hub-Signature-256"), "sha256=")
		if !ok {
			return errors.New("no X-Hub-Signature-256: sha256=... field")
		}
		return c.hexMAC(sig, body)
	case "stripe":
		return c.stripe(h.Get("Stripe-Signature"), body, now)
	case "slack":
		ts := h.Get("X-Slack-Request-Timestamp")
		if err := recent(ts, now); err != nil {
			return fmt.Errorf("X-Slack-Request-Timestamp: %w", err)
		}
		sig, ok := strings.CutPrefix(h.Get("X-Slack-Signature"), "v0=")
		if !ok {
			return errors.New("no X-Slack-Signature: v0=... field")
		}
		return c.hexMAC(sig, []byte("v0:"+ts+":"), body)
	default: // hmac
		v := strings.TrimPrefix(strings.TrimSpace(h.Get(c.header)), "sha256=")
		if v == "" {
			return fmt.Errorf("no %s field", c.header)
		}
		want := c.mac(body)
		if got, err := hex.DecodeString(v); err == nil && hmac.Equal(got, want) {
			return nil
		}
		if got, err := base64.StdEncoding.DecodeString(v); err == nil && hmac.Equal(got, want) {
			return nil
		}
		return fmt.Errorf("%s does not match the body's HMAC-SHA256", c.header)
	}
}

// stripe checks a Stripe-Signature field: t=TIMESTAMP and one or more
// v1=HEX, an HMAC-SHA256 of "TIMESTAMP.BODY"; any v1 may match.
func (c *webhookCheck) stripe(field string, body []byte, now time.Time) error {
	var ts string
	var sigs []string
	for item := range strings.SplitSeq(field, ",") {
		k, v, _ := strings.Cut(strings.TrimSpace(item), "=")
		switch k {
		case "t":
			ts = v
		case "v1":
			sigs = append(sigs, v)
		}
	}
	if ts == "" || len(sigs) == 0 {
		return errors.New("no Stripe-Signature: t=...,v1=... field")
	}
	if err := recent(ts, now); err != nil {
		return fmt.Errorf("Stripe-Signature t: %w", err)
	}
	for _, sig := range sigs {
		if c.hexMAC(sig, []byte(ts+"."), body) == nil {
			return nil
		}
	}
	return errors.New("no v1 of Stripe-Signature matches the body")
}

// hexMAC checks sig, hex, against the HMAC-SHA256 of parts.
func (c *webhookCheck) hexMAC(sig string, parts ...[]byte) error {
	got, err := hex.DecodeString(sig)
	if err != nil || !hmac.Equal(got, c.mac(parts...)) {
		return errors.New("the signature does not match the body")
	}
	return nil
}

func (c *webhookCheck) mac(parts ...[]byte) []byte {
	m := hmac.New(sha256.New, c.secret)
	for _, p := range parts {
		m.Write(p)
	}
	return m.Sum(nil)
}

// recent reports whether ts, Unix seconds, is within webhookTolerance of
// now: an older signed request may be a replay.
func recent(ts string, now time.Time) error {
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return fmt.Errorf("%q is not a Unix time", ts)
	}
	if d := now.Sub(time.Unix(sec, 0)); d > webhookTolerance || d < -webhookTolerance {
		return fmt.Errorf("%s is more than %s from the edge's clock", time.Unix(sec, 0).UTC().Format(time.RFC3339), webhookTolerance)
	}
	return nil
}

// verifyWebhook reads r's body whole (up to VerifyWebhookMaxBody) and
// checks its signature; verified, r's body is what was read. Otherwise it
// answers 403 webhook_unverified, or the visitor's broken body's error.
func (e *Edge) verifyWebhook(w http.ResponseWriter, r *http.Request, rt route, c *webhookCheck) bool {
	host := rt.hostname
	max := e.cfg.VerifyWebhookMaxBody
	var body []byte
	var err error
	if r.Body != nil {
		body, err = io.ReadAll(io.LimitReader(r.Body, max+1))
	}
	switch {
	case err != nil:
		e.visitorFailed(w, r, host, errors.Join(errVisitorRead, err))
		return false
	case int64(len(body)) > max:
		err = fmt.Errorf("the body is over %d bytes (--verify-webhook-max-body)", max)
	default:
		err = c.verify(r.Header, body, time.Now())
	}
	if err != nil {
		e.metrics.webhooks.WithLabelValues(c.provider).Inc()
		e.log.Info("webhook refused: its signature did not verify", "hostname", host, "provider", c.provider, "method", r.Method, "path", r.URL.Path, "reason", err.Error())
		w.Header().Set(webhookReasonHeader, err.Error())
		mux.WriteVisitorErrorFor(w, r, mux.CodeWebhookUnverified, host)
		rt.s.tellRefused(&mux.Refused{Hostname: host, Method: r.Method, Path: r.URL.RequestURI(), Code: mux.CodeWebhookUnverified, Reason: err.Error()})
		return false
	}
	r.Body, r.ContentLength, r.TransferEncoding = io.NopCloser(bytes.NewReader(body)), int64(len(body)), nil
	return true
}

// webhookReasonHeader says, on a 403 webhook_unverified, why: for the
// sender's delivery log. It never carries the secret or a signature.
const webhookReasonHeader = "Ngstone-Webhook-Error"
