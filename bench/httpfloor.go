package main

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// The HTTP floor (-httpfloor) is ngstone's request path with nothing of
// ngstone's on it: the mux floor's link, and on each side net/http's
// server, reverse proxy and transport as the edge and the agent use them.
// The edge-side relay serves visitors and sends each request over a pool
// of yamux streams kept open (the transport dials by opening a stream);
// the agent-side relay serves every stream with one http.Server and sends
// each request to the backend with its own transport. No routing, limits,
// logs, metrics or inspector: what the design costs, apart from ngstone.

// floorIdle bounds each floor transport's idle connections, as the edge
// bounds its idle streams per session by default.
const floorIdle = 64

// httpEdge serves HTTP visitors accepted on vl through the latest session
// accepted on tl, until ctx ends; then it returns ctx's error once every
// connection has ended.
func httpEdge(ctx context.Context, vl, tl net.Listener) error {
	var conns sync.WaitGroup
	defer conns.Wait()
	cur, err := acceptSessions(ctx, tl, vl, &conns)
	if err != nil {
		vl.Close()
		tl.Close()
		return err
	}
	tr := &http.Transport{
		DialContext: func(context.Context, string, string) (net.Conn, error) {
			s := cur.Load()
			if s == nil {
				return nil, errors.New("no agent session")
			}
			return s.OpenStream()
		},
		MaxIdleConns:        floorIdle,
		MaxIdleConnsPerHost: floorIdle,
		DisableCompression:  true,
	}
	defer tr.CloseIdleConnections()
	return serveFloorProxy(ctx, vl, "http://agent", tr)
}

// httpAgent runs a yamux client session over c and serves each stream the
// other side opens with one http.Server relaying to the plain HTTP backend
// at to, until ctx ends or the session does.
func httpAgent(ctx context.Context, c net.Conn, to string) error {
	s, err := floorClient(c)
	if err != nil {
		return err
	}
	tr := &http.Transport{MaxIdleConns: floorIdle, MaxIdleConnsPerHost: floorIdle, DisableCompression: true}
	defer tr.CloseIdleConnections()
	return serveFloorProxy(ctx, s, "http://"+to, tr)
}

// serveFloorProxy serves ln with a reverse proxy to target over tr until
// ctx ends or ln fails.
func serveFloorProxy(ctx context.Context, ln net.Listener, target string, tr *http.Transport) error {
	u, err := url.Parse(target)
	if err != nil {
		ln.Close()
		return err
	}
	rp := &httputil.ReverseProxy{
		Rewrite:    func(pr *httputil.ProxyRequest) { pr.SetURL(u); pr.Out.Host = pr.In.Host },
		Transport:  tr,
		BufferPool: mux.BufferPool{}, // without one, each response allocates 32 KiB
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// As ngstone's sides do: without it, the server closes the request
		// body when the response starts, and a transport still reading it
		// closes the backend's connection under the response (and cuts it).
		rc := http.NewResponseController(w)
		rc.EnableFullDuplex()
		rp.ServeHTTP(w, r)
		// A body left unread panics the server once the handler is gone
		// (golang/go#68560): close it here, the response out, as the agent
		// does.
		if r.Body != http.NoBody && rc.Flush() == nil {
			r.Body.Close()
		}
	})}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	err = srv.Serve(ln)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// startHTTPFloor runs an HTTP edge and an HTTP agent in front of the
// backend's plain listener: the floor has no figure for HTTPS visitors.
func (b *bench) startHTTPFloor() (*peer, error) {
	p := &peer{name: "http floor", targets: map[string]target{}}
	d := b.direct("http")
	listen, tunnel := freePort(), freePort()
	profile := func(role string) []string {
		if b.o.profile == "" {
			return nil
		}
		return []string{"-cpuprofile", filepath.Join(b.o.profile, role+".pprof")}
	}
	args := append([]string{"-listen", listen, "-tunnel", tunnel, "-data-dir", filepath.Join(b.dir, "httpfloor")}, profile("httpedge")...)
	if err := b.startRole(p, "http edge", "httpedge", args...); err != nil {
		return nil, err
	}
	if waitFor(15*time.Second, func() bool { return canDial(tunnel) }) != nil {
		p.stop()
		return nil, errors.New("http floor's edge did not listen within 15s; see its log with -keep")
	}
	args = append([]string{"-edge", tunnel, "-to", strings.TrimPrefix(d.base, "http://")}, profile("httpagent")...)
	if err := b.startRole(p, "http agent", "httpagent", args...); err != nil {
		return nil, err
	}
	d.base = "http://" + listen
	p.targets["http"] = d
	return p, b.waitPeer(p)
}
