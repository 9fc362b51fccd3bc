package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ngstone/ngstone/internal/wan"
)

// The WAN bench (-wan) runs the tunnel's two sides in two network
// namespaces joined by an emulated link (internal/wan): the edge (or
// frps) and the visitors in side A, the agent (or frpc) and the backend in
// side B. Only the agent–edge link crosses the emulated link, as between a
// laptop and a hosted edge. It needs root.
//
// For each profile and each subject (ngstone, the bench binary as edge and
// agent with each -windows value, frp with -frp) it measures:
//
//   - xfer: a -wansize download and upload, median of -wanxfers;
//   - behind: small GETs, one after another, while one visitor downloads
//     without end: their p50 and p90, and the download's rate meanwhile;
//   - peak RSS of the server and client side after the profile;
//   - outage (on -outageprofile only): the link black-holed for
//     -blackhole, then restored; the time from its return to the first
//     visitor 200, -blackholes times.

const (
	wanEdgeAddr  = "127.0.0.1:8080"
	wanCtrlPort  = "4443"
	wanFRPPort   = "7000"
	wanVhostPort = "8081"
)

type wanBench struct {
	o       options
	dir     string
	pair    *wan.Pair
	backend *http.Server
	local   string // the backend's address in side B
	results []wanResult
	outages []outageResult
}

type wanResult struct {
	profile, subject string
	down, up         []float64 // bytes per second, each transfer
	p50, p90         time.Duration
	behindRate       float64
	rssServer        int64
	rssClient        int64
	err              error
}

type outageResult struct {
	profile, subject string
	back             []time.Duration
	err              error
}

// subject is one tunnel measured over the link.
type subject interface {
	name() string
	// start starts its processes in the pair's namespaces and returns the
	// visitors' target in side A once the tunnel answers.
	start(w *wanBench) (*running, error)
}

type running struct {
	target         target
	server, client *proc
}

func (r *running) stop() {
	r.client.stop()
	r.server.stop()
}

func runWAN(o options) error {
	w := &wanBench{o: o}
	var err error
	if w.dir, err = os.MkdirTemp("", "ngstone-wan-"); err != nil {
		return err
	}
	defer w.cleanup()
	w.pair = &wan.Pair{}
	if err := w.pair.Start(); err != nil {
		return fmt.Errorf("wan link (root, /dev/net/tun and ip(8) needed): %w", err)
	}
	if err := w.startBackend(); err != nil {
		return err
	}
	subjects, err := w.subjects()
	if err != nil {
		return err
	}
	logf("load average at start: %s", loadAvg())
	for _, prof := range o.wanProfiles {
		w.pair.Set(prof)
		logf("profile %s: %s", prof.Name, prof.AtoB)
		for _, s := range subjects {
			w.results = append(w.results, w.measure(prof, s))
		}
		if o.wanPhases["outage"] && prof.Name == o.outageProfile {
			for _, s := range subjects {
				w.outages = append(w.outages, w.outage(prof, s))
			}
		}
	}
	logf("load average at end: %s", loadAvg())
	w.print(os.Stdout)
	return nil
}

func (w *wanBench) cleanup() {
	if w.backend != nil {
		w.backend.Close()
	}
	if w.pair != nil {
		w.pair.Close()
	}
	removeTemp(w.dir, w.o.keepTemp)
}

func (w *wanBench) startBackend() error {
	ln, err := w.pair.B.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	w.local = ln.Addr().String()
	w.backend = &http.Server{Handler: backendHandler()}
	go w.backend.Serve(ln)
	return nil
}

func (w *wanBench) subjects() ([]subject, error) {
	var ss []subject
	switch {
	case w.o.bin != "":
		// Several builds side by side: -ngstone BIN,BIN...
		for _, bin := range strings.Split(w.o.bin, ",") {
			ss = append(ss, &ngstoneSubject{label: filepath.Base(bin), bin: bin})
		}
	case len(w.o.windows) == 0:
		logf("building ngstone")
		bin, err := build(w.dir)
		if err != nil {
			return nil, err
		}
		ss = append(ss, &ngstoneSubject{label: "ngstone", bin: bin})
	}
	if len(w.o.windows) > 0 {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		for _, win := range w.o.windows {
			ss = append(ss, &ngstoneSubject{label: "ngstone, window " + sizeName(win), bin: self, self: true, window: win})
		}
	}
	if w.o.frp != "" {
		ss = append(ss, &frpSubject{dir: w.o.frp})
	}
	return ss, nil
}

func sizeName(n uint) string {
	if n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}

// measure runs the xfer and behind phases of s over prof, on fresh
// processes.
func (w *wanBench) measure(prof wan.Profile, s subject) wanResult {
	res := wanResult{profile: prof.Name, subject: s.name()}
	r, err := s.start(w)
	if err != nil {
		res.err = err
		logf("%s %s: %v", prof.Name, s.name(), err)
		return res
	}
	defer r.stop()
	if w.o.wanPhases["xfer"] {
		c := r.target.client(1)
		for range w.o.wanXfers {
			for _, x := range []struct {
				f    func(target, *http.Client, int64) (float64, error)
				into *[]float64
			}{{download, &res.down}, {upload, &res.up}} {
				rate, err := x.f(r.target, c, w.o.wanSize)
				if err != nil {
					res.err = errors.Join(res.err, err)
					continue
				}
				*x.into = append(*x.into, rate)
			}
		}
		c.CloseIdleConnections()
		logf("%s %s: download %s, upload %s", prof.Name, s.name(), mbpsList(res.down), mbpsList(res.up))
	}
	if w.o.wanPhases["behind"] {
		ab0, ba0 := w.pair.Stats()
		lats, rate, err := behindBulk(r.target, 30, 100*time.Millisecond)
		ab1, ba1 := w.pair.Stats()
		logf("%s %s: link queue during behind: A to B %s, B to A %s", prof.Name, s.name(), queueDelay(ab0, ab1), queueDelay(ba0, ba1))
		if err != nil {
			res.err = errors.Join(res.err, err)
		} else {
			res.p50, res.p90, res.behindRate = lats[len(lats)/2], lats[len(lats)*9/10], rate
			logf("%s %s: small GETs behind a download p50 %s p90 %s, download %s", prof.Name, s.name(), secs(res.p50), secs(res.p90), mbps(rate))
		}
	}
	res.rssServer, res.rssClient = r.server.status("VmHWM"), r.client.status("VmHWM")
	return res
}

// behindBulk sends n small GETs, gap apart, while another visitor
// downloads without end, and returns their latencies sorted and the
// download's rate meanwhile.
func behindBulk(t target, n int, gap time.Duration) ([]time.Duration, float64, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	bulk := t.client(1)
	defer bulk.CloseIdleConnections()
	var got atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := bulk.Do(t.request(ctx, http.MethodGet, "/blob?n="+strconv.FormatInt(1<<40, 10), nil, 0))
		if err != nil {
			return
		}
		defer resp.Body.Close()
		buf := make([]byte, 64<<10)
		for {
			k, err := resp.Body.Read(buf)
			got.Add(int64(k))
			if err != nil {
				return
			}
		}
	}()
	// Let the download fill the link and the windows first.
	if err := waitFor(60*time.Second, func() bool { return got.Load() >= 4<<20 }); err != nil {
		return nil, 0, errors.New("behind: the download did not pass 4 MiB within 60s")
	}
	time.Sleep(2 * time.Second)
	small := t.client(1)
	defer small.CloseIdleConnections()
	start, from := time.Now(), got.Load()
	var lats, there, back []time.Duration
	for range n {
		t0 := time.Now()
		at, err := timedGet(ctx, t, small)
		if err != nil {
			return nil, 0, fmt.Errorf("behind: %w", err)
		}
		t1 := time.Now()
		lats, there, back = append(lats, t1.Sub(t0)), append(there, at.Sub(t0)), append(back, t1.Sub(at))
		time.Sleep(gap)
	}
	rate := float64(got.Load()-from) / time.Since(start).Seconds()
	cancel()
	<-done
	for _, s := range [][]time.Duration{lats, there, back} {
		slices.Sort(s)
	}
	logf("behind: request leg p50 %s, response leg p50 %s", secs(there[n/2]), secs(back[n/2]))
	return lats, rate, nil
}

// timedGet sends GET /small?at and returns when the backend got it.
func timedGet(ctx context.Context, t target, c *http.Client) (time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := c.Do(t.request(ctx, http.MethodGet, "/small?at", nil, 0))
	if err != nil {
		return time.Time{}, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	ns, err := strconv.ParseInt(resp.Header.Get("Bench-At"), 10, 64)
	if resp.StatusCode != http.StatusOK || err != nil {
		return time.Time{}, fmt.Errorf("small GET answered %s, Bench-At %q", resp.Status, resp.Header.Get("Bench-At"))
	}
	return time.Unix(0, ns), nil
}

// outage black-holes the link, restores it and times the first visitor
// 200 after its return, -blackholes times, on fresh processes.
func (w *wanBench) outage(prof wan.Profile, s subject) outageResult {
	res := outageResult{profile: prof.Name, subject: s.name()}
	r, err := s.start(w)
	if err != nil {
		res.err = err
		return res
	}
	defer r.stop()
	c := r.target.client(256)
	defer c.CloseIdleConnections()
	for i := range w.o.blackholes {
		if _, ok := waitOK(r.target, c, 120*time.Second, 20*time.Millisecond); !ok {
			res.err = errors.New("not serving 120s after the link returned")
			break
		}
		time.Sleep(2 * time.Second)
		w.pair.Blackhole(true)
		time.Sleep(w.o.blackhole)
		back := time.Now()
		w.pair.Blackhole(false)
		logf("%s %s: outage %d: link back at %s", prof.Name, s.name(), i+1, back.Format("15:04:05.000000"))
		d, err := firstOK(r.target, c, back, 120*time.Second)
		if err != nil {
			res.err = err
			break
		}
		res.back = append(res.back, d)
		logf("%s %s: outage %d: first 200 %s after the link returned", prof.Name, s.name(), i+1, secs(d))
	}
	return res
}

// firstOK starts a GET every 20 ms, each bounded by 10 s, and returns the
// time from since to the first 200.
func firstOK(t target, c *http.Client, since time.Time, timeout time.Duration) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ok := make(chan time.Time, 1)
	sem := make(chan struct{}, 200)
	var wg sync.WaitGroup
	defer wg.Wait()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case at := <-ok:
			cancel()
			return at.Sub(since), nil
		case <-ctx.Done():
			return 0, fmt.Errorf("no 200 within %v of the link's return", timeout)
		case <-tick.C:
		}
		select {
		case sem <- struct{}{}:
		default:
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
			defer rcancel()
			if t.get(rctx, c, "/small") == http.StatusOK {
				select {
				case ok <- time.Now():
				default:
				}
			}
		})
	}
}

// ngstoneSubject is ngstone's edge and agent: the ngstone binary, or the
// bench binary with a stream window of its own (self).
type ngstoneSubject struct {
	label  string
	bin    string
	self   bool
	window uint
}

func (s *ngstoneSubject) name() string { return s.label }

func (s *ngstoneSubject) start(w *wanBench) (*running, error) {
	data := filepath.Join(w.dir, "edge")
	ctrl := net.JoinHostPort(w.pair.AddrA().String(), wanCtrlPort)
	var eargs, aargs, eenv, aenv []string
	if s.self {
		win := strconv.FormatUint(uint64(s.window), 10)
		eenv, aenv = []string{roleEnv + "=edge"}, []string{roleEnv + "=agent"}
		eargs = []string{"-domain", domain, "-http-addr", wanEdgeAddr, "-https-addr", "127.0.0.1:8443",
			"-control-addr", ctrl, "-data-dir", data, "-window", win}
		aargs = []string{"-edge", ctrl, "-server-name", domain, "-ca-file", filepath.Join(data, "ca.pem"),
			"-local", w.local, "-subdomain", mainSub, "-window", win}
	} else {
		eargs = []string{"edge", "--domain", domain, "--http-addr", wanEdgeAddr, "--https-addr", "127.0.0.1:8443",
			"--control-addr", ctrl, "--admin-addr", "", "--data-dir", data, "--tls-mode", "self-signed", "--log-format", "json"}
		aargs = []string{"http", w.local, "--edge", ctrl, "--server-name", domain, "--ca-file", filepath.Join(data, "ca.pem"),
			"--subdomain", mainSub, "--log-format", "json"}
	}
	edge, err := startCmd("edge", w.pair.A.Command(s.bin, eargs...), append(eenv, w.o.childEnv...), filepath.Join(w.dir, "edge.log"))
	if err != nil {
		return nil, err
	}
	r := &running{server: edge}
	if err := waitDial(w.pair.A, ctrl, edge); err != nil {
		r.stop()
		return nil, err
	}
	if r.client, err = startCmd("agent", w.pair.B.Command(s.bin, aargs...), append(aenv, w.o.childEnv...), filepath.Join(w.dir, "agent.log")); err != nil {
		r.stop()
		return nil, err
	}
	r.target = target{base: "http://" + wanEdgeAddr, host: mainSub + "." + domain, dial: w.pair.A.DialContext}
	return r, waitServing(r)
}

// frpSubject is frps and frpc from -frp DIR, with their defaults (TLS and
// yamux between them) and an HTTP vhost proxy for the backend.
type frpSubject struct{ dir string }

func (s *frpSubject) name() string { return "frp" }

func (s *frpSubject) start(w *wanBench) (*running, error) {
	srv := w.pair.AddrA().String()
	_, localPort, _ := net.SplitHostPort(w.local)
	const host = "bench.frp.test"
	files := map[string]string{
		"frps.toml": fmt.Sprintf("bindAddr = %q\nbindPort = %s\nvhostHTTPPort = %s\nlog.level = \"warn\"\n", srv, wanFRPPort, wanVhostPort),
		"frpc.toml": fmt.Sprintf("serverAddr = %q\nserverPort = %s\nlog.level = \"warn\"\n\n"+
			"[[proxies]]\nname = \"bench\"\ntype = \"http\"\nlocalIP = \"127.0.0.1\"\nlocalPort = %s\ncustomDomains = [%q]\n",
			srv, wanFRPPort, localPort, host),
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(w.dir, name), []byte(text), 0o644); err != nil {
			return nil, err
		}
	}
	frps, err := startCmd("frps", w.pair.A.Command(filepath.Join(s.dir, "frps"), "-c", filepath.Join(w.dir, "frps.toml")),
		w.o.childEnv, filepath.Join(w.dir, "frps.log"))
	if err != nil {
		return nil, err
	}
	r := &running{server: frps}
	if err := waitDial(w.pair.A, net.JoinHostPort(srv, wanFRPPort), frps); err != nil {
		r.stop()
		return nil, err
	}
	if r.client, err = startCmd("frpc", w.pair.B.Command(filepath.Join(s.dir, "frpc"), "-c", filepath.Join(w.dir, "frpc.toml")),
		w.o.childEnv, filepath.Join(w.dir, "frpc.log")); err != nil {
		r.stop()
		return nil, err
	}
	r.target = target{base: "http://" + net.JoinHostPort(srv, wanVhostPort), host: host, dial: w.pair.A.DialContext}
	return r, waitServing(r)
}

// waitDial waits until addr accepts connections from inside ns.
func waitDial(ns *wan.NS, addr string, p *proc) error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c, err := ns.DialContext(ctx, "tcp", addr)
		cancel()
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited at start; see its log with -keep", p.name)
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s did not listen on %s within 30s", p.name, addr)
}

func waitServing(r *running) error {
	c := r.target.client(1)
	defer c.CloseIdleConnections()
	if _, ok := waitOK(r.target, c, 60*time.Second, 20*time.Millisecond); !ok {
		r.stop()
		return errors.New("the tunnel did not answer within 60s; see the logs with -keep")
	}
	return nil
}

// queueDelay is the mean wait for the rate of the packets between two
// samples of a direction's stats.
func queueDelay(a, b wan.Stats) string {
	n := b.Delivered - a.Delivered
	if n == 0 {
		return "no packets"
	}
	return fmt.Sprintf("%.1f ms mean over %d packets", float64(b.Waited-a.Waited)/float64(n)/1e6, n)
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

func mbps(bytesPerSecond float64) string { return fmt.Sprintf("%.1f MB/s", bytesPerSecond/1e6) }

func mbpsList(xs []float64) string {
	var s []string
	for _, x := range xs {
		s = append(s, fmt.Sprintf("%.1f", x/1e6))
	}
	return strings.Join(s, ", ") + " MB/s"
}

// rates is the median and each of a list of transfer rates.
func rates(xs []float64) string {
	if len(xs) == 0 {
		return ""
	}
	return mbps(medianOf(xs)) + " (" + mbpsList(xs) + ")"
}

func secs(d time.Duration) string { return fmt.Sprintf("%.3f s", d.Seconds()) }

func medianOf(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// print writes the profiles and the results as Markdown tables.
func (w *wanBench) print(out io.Writer) {
	fmt.Fprintf(out, "command: go run ./bench %s\n\n", strings.Join(os.Args[1:], " "))
	for _, p := range w.o.wanProfiles {
		fmt.Fprintf(out, "- %s: each way %s\n", p.Name, p.AtoB)
	}
	fmt.Fprintf(out, "\n| link | tunnel | %d MiB download (median; each) | upload (median; each) | small GET behind a download, p50 / p90 | download meanwhile | peak RSS server / client |\n", w.o.wanSize>>20)
	fmt.Fprintln(out, "|---|---|---|---|---|---|---|")
	for _, r := range w.results {
		behind, rate := "", ""
		if r.p50 > 0 {
			behind, rate = secs(r.p50)+" / "+secs(r.p90), mbps(r.behindRate)
		}
		errs := ""
		if r.err != nil {
			errs = " (" + strings.ReplaceAll(r.err.Error(), "\n", "; ") + ")"
		}
		fmt.Fprintf(out, "| %s | %s%s | %s | %s | %s | %s | %s / %s |\n", r.profile, r.subject, errs,
			rates(r.down), rates(r.up), behind, rate, mib(r.rssServer), mib(r.rssClient))
	}
	if len(w.outages) == 0 {
		return
	}
	fmt.Fprintf(out, "\n| link | tunnel | first 200 after a %v black-hole ends, median of %d | each |\n|---|---|---|---|\n", w.o.blackhole, w.o.blackholes)
	for _, r := range w.outages {
		ds := slices.Clone(r.back)
		slices.Sort(ds)
		med, each := "", ""
		if len(ds) > 0 {
			med = secs(ds[len(ds)/2])
		}
		for _, d := range r.back {
			each += fmt.Sprintf("%.2f ", d.Seconds())
		}
		if r.err != nil {
			each += "(" + r.err.Error() + ")"
		}
		fmt.Fprintf(out, "| %s | %s | %s | %s |\n", r.profile, r.subject, med, strings.TrimSpace(each))
	}
}
