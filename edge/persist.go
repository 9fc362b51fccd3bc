package edge

import (
	"context"
	"time"

	"github.com/ngstone/ngstone/registry"
)

// A single edge with RegistryFile keeps its bindings across a restart
// (registry.Bolt). An edge that restarts has detected no holder dead, it
// has only forgotten them: after a restart each binding is there, offline,
// and its holder counts as live (rule 3) until its freshness window has
// passed since it was last heard from, counted across the restart. Its own
// instance takes it back at once (rule 1); after the window another
// instance may (rule 2), and the reaper releases it, compare-and-delete.
//
// When a holder was last heard is written every third of the freshness
// window for the bindings of live sessions, in one transaction, never on a
// heartbeat: so what the file says may be a third of the window old, and a
// restored holder counts as live for the window and that third.

// heardEvery is how often the last-heard times of live sessions' bindings
// are written.
func (e *Edge) heardEvery() time.Duration { return e.cfg.HeartbeatTimeout / 3 }

// restoredWindow is how long after it was last heard a holder from before
// a restart counts as live.
func (e *Edge) restoredWindow() time.Duration { return e.cfg.HeartbeatTimeout + e.heardEvery() }

// openRegistry opens the registry file and restores its bindings: offline,
// due for release once their holders' window has passed. Sessions are
// numbered above any the file names, so that one of the process before is
// never taken for one of this process.
func (e *Edge) openRegistry() error {
	b, err := registry.OpenBolt(e.cfg.RegistryFile, e.holderLive)
	if err != nil {
		return err
	}
	e.store, e.persist = b, b
	e.restoredFloor = b.LastSession()
	e.nextSession.Store(e.restoredFloor)
	bs, _ := b.List(context.Background())
	e.mu.Lock()
	for _, b := range bs {
		for _, r := range b.Owners() {
			e.offline = append(e.offline, offlineBinding{host: r.Hostname, session: r.SessionID, gen: r.Generation,
				until: r.LastHeard.Add(e.restoredWindow())})
		}
	}
	e.mu.Unlock()
	e.log.Info("registry opened", "file", e.cfg.RegistryFile, "bindings", len(bs))
	return nil
}

// restored reports whether b's holder is a session of the process before
// a restart.
func (e *Edge) restored(b registry.Binding) bool {
	return e.persist != nil && b.SessionID <= e.restoredFloor
}

// recordHeard writes when the holders of this edge's bindings were last
// heard from: each live session's last heartbeat.
func (e *Edge) recordHeard() {
	if e.persist == nil {
		return
	}
	e.mu.Lock()
	sessions := e.sessionListLocked()
	e.mu.Unlock()
	now := time.Now()
	var held []registry.HeardAt
	for _, s := range sessions {
		if !s.live(now) {
			continue
		}
		at := time.Unix(0, s.lastBeat.Load())
		for h, gen := range s.snapshot() {
			held = append(held, registry.HeardAt{Hostname: h, Generation: gen, At: at})
		}
	}
	if err := e.persist.Heard(held); err != nil {
		e.log.Warn("could not record when agents were last heard from", "err", err)
	}
}
