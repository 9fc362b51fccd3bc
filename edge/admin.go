package edge

import (
	"context"
	"crypto/subtle"
	"net/http"
	"time"

	"github.com/ngstone/ngstone/mux"
	"github.com/ngstone/ngstone/registry"
)

// Tunnel is one binding as the admin API shows it. Online is computed at the
// time of the request, never stored.
type Tunnel struct {
	Hostname   string `json:"hostname"`
	URL        string `json:"url"`
	InstanceID string `json:"instance_id"`
	SessionID  uint64 `json:"session_id"`
	// Node is the edge holding the session, in a cluster. Online,
	// LastHeartbeat and RemoteAddr are measured there, when asked: another
	// edge asks it over the cluster link, and reports its tunnels offline
	// if it does not answer.
	Node          string    `json:"node,omitempty"`
	Generation    uint64    `json:"generation"`
	Online        bool      `json:"online"`
	LastHeartbeat time.Time `json:"last_heartbeat"`
	RemoteAddr    string    `json:"remote_addr"`
	BoundAt       time.Time `json:"bound_at"`
	// Pool: the name is shared by Members, each shown as a tunnel of its
	// own; the fields above are then the pool's (Online: any member is).
	Pool    bool     `json:"pool,omitempty"`
	Members []Tunnel `json:"members,omitempty"`
	// Down, of a member, is why its agent says its local service fails
	// (it takes no new request meanwhile); Requests is how many requests
	// and connections its edge has given it since its session began.
	Down     string `json:"down,omitempty"`
	Requests uint64 `json:"requests,omitempty"`
}

func (e *Edge) adminHandler() http.Handler {
	m := http.NewServeMux()
	m.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if e.cluster != nil && !e.cluster.store.Ready() {
			// A load balancer should send agents to an edge that can
			// vouch for them.
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write([]byte("cluster registry unavailable"))
			return
		}
		if err := e.certs.Status(); err != nil {
			// Agents and visitors would be refused at the handshake.
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write([]byte("certificates: " + err.Error()))
			return
		}
		w.Write([]byte("ok"))
	})
	m.Handle("GET /metrics", e.requireToken(e.metrics.handler()))
	m.Handle("GET /api/tunnels", e.requireToken(http.HandlerFunc(e.listTunnels)))
	m.Handle("GET /api/tunnels/{hostname}", e.requireToken(http.HandlerFunc(e.getTunnel)))
	return m
}

// requireToken answers 401 unless the request carries the admin token as
// a bearer token; with no AdminToken configured it lets every request in.
func (e *Edge) requireToken(next http.Handler) http.Handler {
	if e.cfg.AdminToken == "" {
		return next
	}
	want := []byte("Bearer " + e.cfg.AdminToken)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="ngstone admin"`)
			http.Error(w, "unauthorized: send Authorization: Bearer <admin-token>", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (e *Edge) listTunnels(w http.ResponseWriter, r *http.Request) {
	out, err := e.Tunnels(r.Context())
	if err != nil {
		http.Error(w, "registry unavailable: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	mux.WriteJSON(w, http.StatusOK, out)
}

func (e *Edge) getTunnel(w http.ResponseWriter, r *http.Request) {
	host, err := NormalizeHost(r.PathValue("hostname"))
	if err != nil {
		mux.WriteJSON(w, http.StatusNotFound, map[string]string{"error": "no tunnel with that hostname"})
		return
	}
	b, ok, err := e.store.Get(r.Context(), host)
	if err != nil {
		http.Error(w, "registry unavailable: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	if !ok {
		mux.WriteJSON(w, http.StatusNotFound, map[string]string{"error": "no tunnel " + host})
		return
	}
	mux.WriteJSON(w, http.StatusOK, e.tunnel(b, time.Now(), e.remoteSessions(r.Context(), []registry.Binding{b})))
}

// Tunnels returns the admin view of every binding, computed now.
func (e *Edge) Tunnels(ctx context.Context) ([]Tunnel, error) {
	bs, err := e.store.List(ctx)
	if err != nil {
		return nil, err
	}
	remote := e.remoteSessions(ctx, bs)
	out := make([]Tunnel, 0, len(bs))
	now := time.Now()
	for _, b := range bs {
		out = append(out, e.tunnel(b, now, remote))
	}
	return out, nil
}

// tunnel is b's admin view. Online, LastHeartbeat and RemoteAddr come from
// the session holding b: measured now for a session of this edge, or as
// its edge answered (remote, from remoteSessions) for one of another.
func (e *Edge) tunnel(b registry.Binding, now time.Time, remote map[string]map[uint64]sessionStatus) Tunnel {
	if b.Pool {
		t := Tunnel{Hostname: b.Hostname, URL: first(e.URLs(b.Hostname, b.Proto)), Generation: b.Generation,
			BoundAt: b.BoundAt.UTC(), Pool: true}
		for _, m := range b.Members {
			mt := e.tunnel(m, now, remote)
			mt.URL = ""
			// As the member's own edge counts it; the registry's health
			// when that edge did not answer.
			var ps poolStatus
			ok := false
			if !e.local(m) {
				ps, ok = remote[m.Node][m.SessionID].Pools[b.Hostname]
			} else if s := e.session(m.SessionID); s != nil {
				ps, ok = s.status(now).Pools[b.Hostname]
			}
			mt.Down, mt.Requests = ps.Down, ps.Requests
			if !ok {
				mt.Down = m.Down
			}
			t.Online = t.Online || mt.Online
			t.Members = append(t.Members, mt)
		}
		return t
	}
	t := Tunnel{
		Hostname: b.Hostname, URL: first(e.URLs(b.Hostname, b.Proto)), InstanceID: b.InstanceID,
		SessionID: b.SessionID, Generation: b.Generation, BoundAt: b.BoundAt.UTC(), Node: b.Node,
	}
	var st sessionStatus
	var ok bool
	if e.local(b) {
		if s := e.session(b.SessionID); s != nil {
			st, ok = s.status(now), true
		}
	} else {
		st, ok = remote[b.Node][b.SessionID]
	}
	if ok {
		t.Online, t.LastHeartbeat, t.RemoteAddr = st.Online, st.LastHeartbeat, st.RemoteAddr
	}
	return t
}
