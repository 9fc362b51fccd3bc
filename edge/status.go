package edge

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/ngstone/ngstone/registry"
)

// In a cluster only the edge holding a session can measure it. The admin
// API of another edge asks that edge, over the cluster link (mutual TLS),
// for the liveness of its sessions at the time of the call.

// sessionsPath is the cluster link's path for the liveness of an edge's
// sessions, asked with Host clusterServerName.
const sessionsPath = "/sessions"

// remoteStatusTimeout bounds the wait for another edge's answer; an edge
// that does not answer in time leaves its tunnels offline in the listing.
const remoteStatusTimeout = 2 * time.Second

// sessionStatus is a session's liveness, as its edge measures it.
type sessionStatus struct {
	ID            uint64    `json:"id"`
	Online        bool      `json:"online"`
	LastHeartbeat time.Time `json:"last_heartbeat"`
	RemoteAddr    string    `json:"remote_addr"`
	// Pools: the session's part in each pool it is a member of.
	Pools map[string]poolStatus `json:"pools,omitempty"`
}

// poolStatus is a member's health and the requests and connections its
// edge has routed to it.
type poolStatus struct {
	Down     string `json:"down,omitempty"`
	Requests uint64 `json:"requests"`
}

func (s *session) status(now time.Time) sessionStatus {
	st := sessionStatus{
		ID: s.id, Online: s.live(now), RemoteAddr: s.remote,
		LastHeartbeat: time.Unix(0, s.lastBeat.Load()).UTC(),
	}
	s.mu.Lock()
	for host, m := range s.members {
		if st.Pools == nil {
			st.Pools = map[string]poolStatus{}
		}
		st.Pools[host] = poolStatus{Down: m.down, Requests: m.picked}
	}
	s.mu.Unlock()
	return st
}

// sessionStatuses measures every session of this edge now.
func (e *Edge) sessionStatuses(now time.Time) []sessionStatus {
	e.mu.Lock()
	sessions := e.sessionListLocked()
	e.mu.Unlock()
	out := make([]sessionStatus, 0, len(sessions))
	for _, s := range sessions {
		out = append(out, s.status(now))
	}
	return out
}

// remoteSessions asks, all at once, each other edge holding one of bs for
// the liveness of its sessions: node, then session id. An edge that cannot
// be asked is missing from the answer, and its tunnels show offline.
func (e *Edge) remoteSessions(ctx context.Context, bs []registry.Binding) map[string]map[uint64]sessionStatus {
	if e.cluster == nil {
		return nil
	}
	nodes := map[string]bool{}
	for _, b := range bs {
		for _, o := range b.Owners() {
			if !e.local(o) {
				nodes[o.Node] = true
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, remoteStatusTimeout)
	defer cancel()
	var mu sync.Mutex
	var wg sync.WaitGroup
	out := map[string]map[uint64]sessionStatus{}
	for node := range nodes {
		wg.Go(func() {
			sts, err := e.askSessions(ctx, node)
			if err != nil {
				e.log.Warn("admin: could not ask another edge for its sessions; its tunnels show offline", "node", node, "err", err)
				return
			}
			m := make(map[uint64]sessionStatus, len(sts))
			for _, st := range sts {
				m[st.ID] = st
			}
			mu.Lock()
			out[node] = m
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// askSessions asks node for the liveness of its sessions.
func (e *Edge) askSessions(ctx context.Context, node string) ([]sessionStatus, error) {
	addr, ok := e.cluster.store.NodeAddr(node)
	if !ok {
		return nil, fmt.Errorf("no address for node %q in the registry", node)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+addr+sessionsPath, nil)
	if err != nil {
		return nil, err
	}
	req.Host = clusterServerName
	resp, err := e.cluster.forward.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s answered %s", node, resp.Status)
	}
	var sts []sessionStatus
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&sts); err != nil {
		return nil, fmt.Errorf("%s's answer: %w", node, err)
	}
	return sts, nil
}
