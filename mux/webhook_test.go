package mux

import (
	"strings"
	"testing"
)

// TestWebhookValidate: what the agent checks before a bind and the edge
// checks of every bind, each field both ways.
func TestWebhookValidate(t *testing.T) {
	for _, tc := range []struct {
		w   Webhook
		bad string // the flag the error names; "" for a valid one
	}{
		{Webhook{Provider: "github", Secret: "s"}, ""},
		{Webhook{Provider: "stripe", Secret: strings.Repeat("s", MaxWebhookSecret)}, ""},
		{Webhook{Provider: "hmac", Secret: "s", Header: "X-Signature"}, ""},
		{Webhook{Provider: "gitlab", Secret: "s"}, "verify-webhook "},
		{Webhook{Provider: "slack"}, "verify-webhook-secret-file"},
		{Webhook{Provider: "slack", Secret: strings.Repeat("s", MaxWebhookSecret+1)}, "verify-webhook-secret-file"},
		{Webhook{Provider: "hmac", Secret: "s"}, "verify-webhook-header"},
		{Webhook{Provider: "hmac", Secret: "s", Header: "X Sig"}, "verify-webhook-header"},
		{Webhook{Provider: "github", Secret: "s", Header: "X-Signature"}, "verify-webhook-header"},
	} {
		err := tc.w.Validate()
		if tc.bad == "" && err != nil || tc.bad != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.bad)) {
			t.Errorf("%+v: %v; want an error naming %q (none if empty)", tc.w, err, tc.bad)
		}
	}
}
