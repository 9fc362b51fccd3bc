package agent

import (
	"context"
	"crypto/tls"
	"net"
	"net/url"
	"time"
)

// newPool returns the pool of connections to the local service: plain TCP
// for http://, TLS (HTTP/1.1, the local certificate verified against the
// system's roots) for https://.
func (a *Agent) newPool() *localPool {
	dialer := &net.Dialer{Timeout: a.cfg.UpstreamDialTimeout, KeepAlive: 30 * time.Second}
	addr := hostPort(a.local)
	dial := func() (net.Conn, error) { return dialer.Dial("tcp", addr) }
	if a.local.Scheme == "https" {
		td := &tls.Dialer{NetDialer: dialer, Config: &tls.Config{ServerName: a.local.Hostname()}}
		dial = func() (net.Conn, error) { return td.DialContext(context.Background(), "tcp", addr) }
	}
	return &localPool{
		dial:        dial,
		maxIdle:     256,
		idleTimeout: 90 * time.Second,
		probeIdle:   defaultProbeIdle,
	}
}

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
