package agent

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// hostPort is u's HOST:PORT, with the scheme's port if u names none.
func hostPort(u *url.URL) string {
	if u.Port() != "" {
		return u.Host
	}
	if u.Scheme == "https" {
		return net.JoinHostPort(u.Hostname(), "443")
	}
	return net.JoinHostPort(u.Hostname(), "80")
}

// loadUpstreamCA reads --upstream-ca-file into the local service's TLS
// configuration, before any connection to it.
func (t *tunnel) loadUpstreamCA() error {
	if t.upstreamTLS == nil || t.cfg.UpstreamCAFile == "" {
		return nil
	}
	pool, err := readCAFile("upstream-ca-file", t.cfg.UpstreamCAFile)
	if err != nil {
		return t.wrap(err)
	}
	t.upstreamTLS.RootCAs = pool
	return nil
}

// readCAFile reads a PEM bundle of CA certificates; flag names the setting
// in errors.
func readCAFile(flag, path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s %s: no PEM certificate in it", flag, path)
	}
	return pool, nil
}

// localWarnEvery bounds how often failed requests to the local service are
// logged as warnings; the ones in between are counted in the next.
const localWarnEvery = 10 * time.Second

// localFailures rate-limits the warnings of failed local requests.
type localFailures struct {
	mu     sync.Mutex
	last   time.Time
	unsaid int
}

// due reports whether a warning may be logged now (at most once every
// localWarnEvery) and how many were not since the last one; one that may
// not is counted.
func (f *localFailures) due() (unsaid int, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	if !f.last.IsZero() && now.Sub(f.last) < localWarnEvery {
		f.unsaid++
		return 0, false
	}
	unsaid = f.unsaid
	f.last, f.unsaid = now, 0
	return unsaid, true
}

// strayBytes warns, at most once every localWarnEvery, of a connection to
// the local service that received bytes nobody asked for.
func (t *tunnel) strayBytes() { warnStray(t.log, &t.strays, "local", t.local.String()) }

// StrayWarner warns, at most once every 10 s, of the bytes a local service
// sent unasked that net/http's transport found on an idle connection (a
// body after HEAD, 204 or 304, or past its Content-Length) before the
// agent's own check did. The transport reports those only through the
// standard logger, with the bytes, which may be another visitor's data;
// the program owns that logger's output, and passes each such report here
// (Warn) in place of the line.
type StrayWarner struct {
	log *slog.Logger
	f   localFailures
}

// NewStrayWarner returns a StrayWarner that logs to log.
func NewStrayWarner(log *slog.Logger) *StrayWarner { return &StrayWarner{log: log} }

// Warn warns of one report, unless one was warned of within 10 s.
func (w *StrayWarner) Warn() { warnStray(w.log, &w.f, "from", "net/http") }

// warnStray logs the warning of stray bytes, with args, when f allows it.
func warnStray(log *slog.Logger, f *localFailures, args ...any) {
	unsaid, due := f.due()
	if !due {
		return
	}
	log.Warn("the local service sent bytes nobody asked for (a body after HEAD, 204 or 304, or past its Content-Length): that connection was closed, and no visitor got them",
		append(args, "times_not_logged", unsaid)...)
}

// localFailed logs a request the local service failed, as a warning with a
// hint at the likely fix, at most once every localWarnEvery; http2 says
// the request's connection began with an HTTP/2 frame from the local
// service.
func (t *tunnel) localFailed(code string, err error, http2 bool) {
	if code == mux.CodeUpstreamUnreachable {
		t.poolFailed(err)
	}
	unsaid, due := t.failures.due()
	if !due {
		return
	}
	args := []any{"code", code, "local", t.local.String(), "err", err}
	if hint := localHint(t.local, code, err, http2); hint != "" {
		args = append(args, "hint", hint)
	}
	if unsaid > 0 {
		args = append(args, "failures_not_logged", unsaid)
	}
	t.log.Warn("request to the local service failed", args...)
}

// localHint says what to do about a request to the local service that
// failed with err (visitor error code code), on a connection that began
// with an HTTP/2 frame if http2.
func localHint(local *url.URL, code string, err error, http2 bool) string {
	var cert *tls.CertificateVerificationError
	switch {
	case errors.As(err, &cert):
		return "the local service's certificate is not trusted: give its CA with --upstream-ca-file, or skip the check with --upstream-insecure"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "nothing accepts connections at " + hostPort(local) + ": is the local service running?"
	case code == mux.CodeUpstreamTimeout:
		return "the local service sent no response headers, or took none of the request body, within --upstream-timeout"
	case code == mux.CodeBadResponse && (http2 || strings.Contains(err.Error(), http2Answer)):
		return "the local service answered in HTTP/2 (a gRPC server?): run the tunnel with --upstream-protocol http2"
	}
	return ""
}

// http2Answer is how net/http reports an HTTP/2 frame where it read for an
// HTTP/1.1 status line, as an h2c-only server (a gRPC server) sends its
// SETTINGS frame: a frame starts with its 24-bit length, whose first byte
// is 0 for any frame under 64 KiB, and no status line starts with NUL.
const http2Answer = `malformed HTTP response "\x00`
