package mux

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestWriteVisitorError(t *testing.T) {
	tests := map[string]int{
		CodeTunnelNotFound:      404,
		CodeTunnelOffline:       503,
		CodeUpstreamUnreachable: 502,
		CodeUpstreamTimeout:     504,
		CodeTunnelInterrupted:   502,
		CodeTunnelTimeout:       504,
		CodeBadHost:             400,
		CodeMisdirected:         421,
		CodeHeadersTooLarge:     431,
		CodeBodyTooLarge:        413,
		CodeTooManyRequests:     503,
		CodeBasicAuthRequired:   401,
		CodeBadResponse:         502,
		CodeBadRequest:          400,
		CodeMethodNotAllowed:    405,
		CodeVisitorLimit:        429,
		CodeIPDenied:            403,
		CodeWebhookUnverified:   403,
		CodeOAuthRequired:       401,
		CodeOAuthDenied:         403,
		CodeOAuthFailed:         400,
	}
	if len(tests) != len(visitorErrors) {
		t.Fatalf("the test pins %d codes, visitorErrors has %d", len(tests), len(visitorErrors))
	}
	for code, status := range tests {
		t.Run(code, func(t *testing.T) {
			const host = "app.example.com"
			rec := httptest.NewRecorder()
			WriteVisitorError(rec, code, host)
			if rec.Code != status || VisitorStatus(code) != status {
				t.Errorf("status %d (VisitorStatus %d), want %d", rec.Code, VisitorStatus(code), status)
			}
			if got := rec.Header().Get(ErrorHeader); got != code {
				t.Errorf("%s: %q, want %q", ErrorHeader, got, code)
			}
			if got, want := rec.Header().Get("Retry-After"), retryAfter(status); got != want {
				t.Errorf("Retry-After %q, want %q", got, want)
			}
			if got := rec.Header().Get("WWW-Authenticate"); (got != "") != (status == http.StatusUnauthorized) {
				t.Errorf("WWW-Authenticate %q on a %d", got, status)
			}
			if ct := rec.Header().Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
				t.Errorf("Content-Type %q", ct)
			}
			body := rec.Body.String()
			if !strings.Contains(body, host) || !strings.Contains(body, code) || !strings.HasSuffix(body, "\n") || strings.Count(body, "\n") != 1 {
				t.Errorf("body %q: want one line naming %s and %s", body, host, code)
			}
		})
	}
}

func retryAfter(status int) string {
	if status == http.StatusServiceUnavailable || status == http.StatusTooManyRequests {
		return "1"
	}
	return ""
}

func TestWriteVisitorErrorUnknownCode(t *testing.T) {
	rec := httptest.NewRecorder()
	WriteVisitorError(rec, "no_such_code", "h.example.com")
	if rec.Code != http.StatusBadGateway || VisitorStatus("no_such_code") != http.StatusBadGateway {
		t.Fatalf("status %d, want 502", rec.Code)
	}
	if rec.Header().Get(ErrorHeader) != "no_such_code" || !strings.Contains(rec.Body.String(), "h.example.com") {
		t.Fatalf("header %q body %q", rec.Header().Get(ErrorHeader), rec.Body.String())
	}
}

// TestVisitorErrorHostIsQuoted checks that a hostile Host cannot add lines
// to the body of a bad_host answer.
func TestVisitorErrorHostIsQuoted(t *testing.T) {
	rec := httptest.NewRecorder()
	WriteVisitorError(rec, CodeBadHost, "evil\r\nX-Injected: 1")
	if strings.Count(rec.Body.String(), "\n") != 1 {
		t.Fatalf("body %q has more than one line", rec.Body.String())
	}
}

// TestWriteVisitorErrorGRPC: a gRPC call gets the same status and code,
// and a grpc-status with the sentence in a response without a body.
func TestWriteVisitorErrorGRPC(t *testing.T) {
	for code, want := range map[string]string{
		CodeUpstreamUnreachable: "14", CodeTunnelNotFound: "12", CodeBasicAuthRequired: "16",
		CodeBodyTooLarge: "8", CodeBadRequest: "13", CodeTunnelTimeout: "14",
	} {
		req := httptest.NewRequest("POST", "/pkg.Service/Method", nil)
		req.Header.Set("Content-Type", "application/grpc+proto")
		rec := httptest.NewRecorder()
		WriteVisitorErrorFor(rec, req, code, "app.example.com")
		if rec.Code != VisitorStatus(code) || rec.Header().Get(ErrorHeader) != code || rec.Header().Get("Grpc-Status") != want ||
			rec.Header().Get("Content-Type") != "application/grpc" || rec.Body.Len() != 0 ||
			!strings.Contains(rec.Header().Get("Grpc-Message"), "app.example.com") {
			t.Errorf("%s: %d %v %q", code, rec.Code, rec.Header(), rec.Body.String())
		}
	}
	plain := httptest.NewRequest("GET", "/", nil)
	rec := httptest.NewRecorder()
	WriteVisitorErrorFor(rec, plain, CodeTunnelNotFound, "app.example.com")
	if rec.Header().Get("Grpc-Status") != "" || rec.Body.Len() == 0 {
		t.Errorf("a plain request got a gRPC answer: %v", rec.Header())
	}
}
