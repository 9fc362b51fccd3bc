package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/mux"
)

// The mux floor (-muxfloor) is the link DESIGN.md fixes between agent and
// edge, with nothing on top: one TLS connection carrying yamux streams,
// built from ngstone's own mux package (batched socket, coalesced frames,
// the same stream window). The edge-side relay opens one stream per visitor
// connection and copies bytes; the agent-side relay dials the backend for
// each stream and copies bytes. There is no HTTP parsing, no routing and no
// stream per request: what any tunnel on that link costs on this machine,
// with frp's and rathole's TCP tunnels as its kin.

// muxDomain names the mux floor's self-signed certificate.
const muxDomain = "muxfloor.bench.test"

// runFloorEdge runs serve, a floor's edge side (muxEdge, httpEdge), with
// visitors accepted on listen and agents on tunnel, under TLS with a
// self-signed certificate kept in dataDir, until ctx ends.
func runFloorEdge(ctx context.Context, listen, tunnel, dataDir string, serve func(ctx context.Context, vl, tl net.Listener) error) error {
	m, err := certs.New(certs.Config{Mode: certs.ModeSelfSigned, Domain: muxDomain, DataDir: dataDir}, nil, nil)
	if err != nil {
		return err
	}
	if err := m.Start(ctx); err != nil {
		return err
	}
	defer m.Close()
	vl, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	tl, err := net.Listen("tcp", tunnel)
	if err != nil {
		vl.Close()
		return err
	}
	return serve(ctx, vl, tls.NewListener(mux.BatchedListener(tl), m.TLSConfig()))
}

// muxEdge serves visitors accepted on vl through the latest session accepted
// on tl, until ctx ends; then it returns ctx's error once every connection
// has ended.
func muxEdge(ctx context.Context, vl, tl net.Listener) error {
	var conns sync.WaitGroup
	defer conns.Wait()
	cur, err := acceptSessions(ctx, tl, vl, &conns)
	if err != nil {
		return err
	}
	for {
		c, err := vl.Accept()
		if err != nil {
			return ctx.Err()
		}
		conns.Go(func() {
			defer c.Close()
			s := cur.Load()
			if s == nil {
				return
			}
			st, err := s.OpenStream()
			if err != nil {
				return
			}
			splice(c.(*net.TCPConn), st)
		})
	}
}

// acceptSessions serves a yamux session on each agent connection accepted
// on tl (in a goroutine counted in conns) and keeps the latest in the
// pointer it returns, closing the one before. When ctx ends it closes vl,
// tl and every session.
func acceptSessions(ctx context.Context, tl, vl net.Listener, conns *sync.WaitGroup) (*atomic.Pointer[yamux.Session], error) {
	yc, err := mux.DefaultConfig().Yamux(nil)
	if err != nil {
		return nil, err
	}
	var cur atomic.Pointer[yamux.Session]
	var sessions []*yamux.Session
	var mu sync.Mutex
	context.AfterFunc(ctx, func() {
		vl.Close()
		tl.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, s := range sessions {
			s.Close()
		}
	})
	conns.Go(func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			// Only a connection that completes its handshake is the agent:
			// the bench's readiness probe connects and closes, and may be
			// handed over after the agent's connection.
			if tc, ok := c.(*tls.Conn); ok {
				tc.SetDeadline(time.Now().Add(5 * time.Second))
				err := tc.Handshake()
				tc.SetDeadline(time.Time{})
				if err != nil {
					c.Close()
					continue
				}
			}
			s, err := yamux.Server(mux.Coalesce(c), yc)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			if ctx.Err() != nil {
				mu.Unlock()
				s.Close()
				return
			}
			sessions = append(sessions, s)
			mu.Unlock()
			if old := cur.Swap(s); old != nil {
				old.Close()
			}
		}
	})
	return &cur, nil
}

// runFloorAgent dials a floor edge's tunnel listener at edge and runs
// serve, the floor's agent side (muxAgent, httpAgent), over the
// connection with next hop to, until ctx ends.
func runFloorAgent(ctx context.Context, edge, to string, serve func(ctx context.Context, c net.Conn, to string) error) error {
	raw, err := net.Dial("tcp", edge)
	if err != nil {
		return err
	}
	// The floor measures cost, not trust: the certificate is the mux edge's
	// own self-signed one, made a moment ago.
	c := tls.Client(mux.Batched(raw), &tls.Config{ServerName: muxDomain, InsecureSkipVerify: true})
	return serve(ctx, c, to)
}

// muxAgent runs a yamux client session over c and relays each stream the
// other side opens to a new connection to to, until ctx ends or the session
// does; it returns once every stream has ended.
func muxAgent(ctx context.Context, c net.Conn, to string) error {
	s, err := floorClient(c)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { s.Close() })
	defer stop()
	var streams sync.WaitGroup
	defer streams.Wait()
	defer s.Close()
	for {
		st, err := s.AcceptStream()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("mux floor session: %w", err)
		}
		streams.Go(func() {
			defer st.Close()
			u, err := net.Dial("tcp", to)
			if err != nil {
				return
			}
			defer u.Close()
			splice(u.(*net.TCPConn), st)
		})
	}
}

// floorClient runs the agent side's yamux session over c, as ngstone's
// agent does (coalesced writes, the mux's defaults); c is closed if it
// cannot.
func floorClient(c net.Conn) (*yamux.Session, error) {
	yc, err := mux.DefaultConfig().Yamux(nil)
	if err != nil {
		c.Close()
		return nil, err
	}
	s, err := yamux.Client(mux.Coalesce(c), yc)
	if err != nil {
		c.Close()
		return nil, err
	}
	return s, nil
}

// splice copies both ways between a socket and a stream, passing each
// side's end on as a half-close, and returns when both ways are done.
func splice(c *net.TCPConn, st *yamux.Stream) {
	var wg sync.WaitGroup
	wg.Go(func() {
		io.Copy(st, c)
		st.Close() // yamux's Close is a half-close: the stream still reads
	})
	io.Copy(c, st)
	c.CloseWrite()
	wg.Wait()
}

// startMuxFloor runs a mux edge and a mux agent in front of the backend's
// plain and TLS listeners; TLS, for the HTTPS rows, is the backend's own,
// end to end, inside the tunnel's TLS.
func (b *bench) startMuxFloor() (*peer, error) {
	p := &peer{name: "mux floor", targets: map[string]target{}}
	for _, scheme := range b.peerSchemes() {
		d := b.direct(scheme)
		to := strings.TrimPrefix(d.base, scheme+"://")
		listen, tunnel := freePort(), freePort()
		dir := filepath.Join(b.dir, "muxfloor-"+scheme)
		if err := b.startRole(p, "mux edge "+scheme, "muxedge", "-listen", listen, "-tunnel", tunnel, "-data-dir", dir); err != nil {
			return nil, err
		}
		if waitFor(15*time.Second, func() bool { return canDial(tunnel) }) != nil {
			p.stop()
			return nil, errors.New("mux edge did not listen within 15s; see its log with -keep")
		}
		if err := b.startRole(p, "mux agent "+scheme, "muxagent", "-edge", tunnel, "-to", to); err != nil {
			return nil, err
		}
		d.base = scheme + "://" + listen
		p.targets[scheme] = d
	}
	return p, b.waitPeer(p)
}
