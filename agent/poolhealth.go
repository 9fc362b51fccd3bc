package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// poolHealth is what a pool member's agent last found of its local
// service: "" when it answers, else why not.
type poolHealth struct {
	mu   sync.Mutex
	down string
}

// poolFailed takes t out of its pool at once: a request found its local
// service unreachable. The health check brings it back.
func (t *tunnel) poolFailed(err error) {
	if t.cfg.Pool {
		t.setHealth(err)
	}
}

// setHealth records the outcome of a check of t's local service (err nil:
// it answers) and, when that changes, tells the edge and the status.
func (t *tunnel) setHealth(err error) {
	down := ""
	if err != nil {
		down = err.Error()
		if len(down) > 200 {
			down = down[:200]
		}
	}
	t.health.mu.Lock()
	changed := (t.health.down == "") != (down == "")
	t.health.down = down
	t.health.mu.Unlock()
	if !changed {
		return
	}
	a := t.a
	var host string
	a.setStatus(func(*Status) { t.st.Down, host = down, t.st.Hostname })
	if down != "" {
		t.log.Warn("local service down: out of the pool until it answers again", "local", t.local.String(), "err", err)
	} else {
		t.log.Info("local service answers again: back in the pool", "local", t.local.String())
	}
	if c := a.current.Load(); c != nil && host != "" {
		c.tellHealth(t, host, down)
	}
}

// tellHealth sends the edge t's health on c, if c holds host for t.
func (c *conn) tellHealth(t *tunnel, host, down string) {
	c.mu.Lock()
	held := c.held[host] == t
	c.mu.Unlock()
	if !held {
		return
	}
	if err := c.send(&mux.Health{Hostname: host, Down: down != "", Reason: down}, c.a.cfg.HeartbeatInterval); err != nil {
		t.log.Debug("health not sent", "err", err)
	}
}

// tellDown tells the edge of a new session which of its pool members are
// down: a session starts with every member up.
func (c *conn) tellDown() {
	c.mu.Lock()
	held := make(map[string]*tunnel, len(c.held))
	for h, t := range c.held {
		held[h] = t
	}
	c.mu.Unlock()
	for h, t := range held {
		t.health.mu.Lock()
		down := t.health.down
		t.health.mu.Unlock()
		if t.cfg.Pool && down != "" {
			c.tellHealth(t, h, down)
		}
	}
}

// watchHealth checks t's local service every PoolHealthInterval until ctx
// ends.
func (t *tunnel) watchHealth(ctx context.Context) {
	tick := time.NewTicker(t.cfg.PoolHealthInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			err := t.checkLocal(ctx)
			if ctx.Err() != nil {
				return
			}
			t.setHealth(err)
		}
	}
}

// errUnhealthy: the health path answered, but not with 2xx.
var errUnhealthy = errors.New("the health check answered")

// checkLocal asks t's local service its health path, or without one
// connects to it; each bounded by the dial timeout.
func (t *tunnel) checkLocal(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, t.cfg.UpstreamDialTimeout)
	defer cancel()
	if t.cfg.PoolHealthPath == "" {
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", hostPort(t.local))
		if err != nil {
			return err
		}
		return c.Close()
	}
	u := *t.local
	u.Path, u.RawPath, u.RawQuery = "", "", ""
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String()+t.cfg.PoolHealthPath, nil)
	if err != nil {
		return err
	}
	if t.hostHeader != "" {
		req.Host = t.hostHeader
	}
	resp, err := t.transport().RoundTrip(req)
	if err != nil {
		return err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("%w %d at %s", errUnhealthy, resp.StatusCode, t.cfg.PoolHealthPath)
	}
	return nil
}
