package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ngstone/ngstone/agent"
)

const (
	domain  = "bench.test"
	mainSub = "bench"
)

// bench holds the run: the backend, the child edge and agent, and the rows
// of the result table.
type bench struct {
	o      options
	dir    string
	bin    string
	be     *backend
	addrs  map[string]string // http, https, control
	edge   *proc
	agent  *proc
	starts int
	ca     *x509.CertPool
	peers  []*peer
	tcp    *tcpService // the tcp phase's local service; nil without it
	rows   []row
}

// row is one line of the table; direct and ratio are empty when there is
// nothing to compare with.
type row struct {
	name, direct, tunnel, ratio, target, verdict string
}

func newBench(o options) (*bench, error) {
	dir, err := os.MkdirTemp("", "ngstone-bench-")
	if err != nil {
		return nil, err
	}
	b := &bench{o: o, dir: dir, addrs: map[string]string{
		"http": freePort(), "https": freePort(), "control": freePort(),
	}}
	switch {
	case o.self:
		b.bin, err = os.Executable()
	case o.bin != "":
		b.bin = o.bin
	default:
		logf("building ngstone")
		b.bin, err = build(dir)
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if o.profile != "" {
		if err := os.MkdirAll(o.profile, 0o755); err != nil {
			return nil, err
		}
	}
	b.be = newBackend()
	if o.phases["tcp"] {
		if b.tcp, err = newTCPService(o.size); err != nil {
			return nil, err
		}
		b.addrs["tcp"] = freePort()
	}
	return b, nil
}

func (b *bench) close() {
	for _, p := range b.peers {
		p.stop()
	}
	b.agent.stop()
	b.edge.stop()
	b.be.close()
	if b.tcp != nil {
		b.tcp.close()
	}
	removeTemp(b.dir, b.o.keepTemp)
}

// removeTemp removes the run's temporary directory, unless keep (-keep).
func removeTemp(dir string, keep bool) {
	if keep {
		logf("child logs kept in %s", dir)
		return
	}
	os.RemoveAll(dir)
}

func (b *bench) run() error {
	if err := b.startEdge(); err != nil {
		return err
	}
	var err error
	if b.agent, err = b.startAgent(mainSub, b.addrs["control"]); err != nil {
		return err
	}
	if err := b.startPeers(); err != nil {
		return err
	}
	phases := []struct {
		name string
		f    func() error
	}{
		{"get", b.smallGETs},
		{"xfer", b.transfers},
		{"rss", b.peakRSS},
		{"reset", b.resets},
		{"outage", b.outages},
		{"idle", b.idleTunnels},
		{"grpc", b.grpcUnary},
		{"tcp", b.tcpPhase},
	}
	for _, p := range phases {
		if !b.o.phases[p.name] && !(p.name == "rss" && (b.o.phases["get"] || b.o.phases["xfer"])) {
			continue
		}
		if err := p.f(); err != nil {
			return fmt.Errorf("%s: %w", p.name, err)
		}
	}
	return nil
}

// startEdge starts the edge on the bench's fixed ports and data directory,
// and waits until its listeners accept.
func (b *bench) startEdge() error {
	b.starts++
	dataDir := filepath.Join(b.dir, "edge")
	var args, env []string
	if b.o.self {
		env = []string{roleEnv + "=edge"}
		args = []string{"-domain", domain, "-http-addr", b.addrs["http"], "-https-addr", b.addrs["https"],
			"-control-addr", b.addrs["control"], "-data-dir", dataDir, "-window", strconv.FormatUint(uint64(b.o.window), 10),
			"-max-requests-per-ip", strconv.Itoa(b.perIP())}
		if b.o.profile != "" {
			args = append(args, "-cpuprofile", filepath.Join(b.o.profile, fmt.Sprintf("edge-%d.pprof", b.starts)))
			if b.o.contention {
				args = append(args, "-contention")
			}
		}
	} else {
		args = []string{"edge", "--domain", domain, "--http-addr", b.addrs["http"], "--https-addr", b.addrs["https"],
			"--control-addr", b.addrs["control"], "--admin-addr", "", "--data-dir", dataDir,
			"--tls-mode", "self-signed", "--log-format", "json", "--max-requests-per-ip", strconv.Itoa(b.perIP()),
			// The idle phase's agents all come from 127.0.0.1.
			"--max-agent-conns-per-ip", "0"}
		if tcp := b.addrs["tcp"]; tcp != "" {
			_, port, _ := net.SplitHostPort(tcp)
			args = append(args, "--tcp-ports", port)
		}
	}
	p, err := startProc("edge", b.bin, args, append(env, b.o.childEnv...), filepath.Join(b.dir, "edge.log"))
	if err != nil {
		return err
	}
	b.edge = p
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.DialTimeout("tcp", b.addrs["control"], time.Second); err == nil {
			c.Close()
			// The edge listens before it has written its CA.
			if err := b.loadCA(dataDir); err == nil || !errors.Is(err, os.ErrNotExist) && !errors.Is(err, errNoCA) {
				return err
			}
		}
		select {
		case <-p.done:
			return errors.New("edge exited at start; see its log with -keep")
		case <-time.After(5 * time.Millisecond):
		}
	}
	return errors.New("edge did not listen within 15s")
}

// perIP is the edge's bound on one visitor address's requests in flight:
// every visitor of the bench comes from 127.0.0.1, so it is raised above
// the largest concurrency measured (the edge's default, 64, answers the
// rest of a c=256 run with 429), to twice it: a request's slot is given
// back just after its response has gone, so a visitor that sends its next
// request at once may find its last one still counted (at exactly the
// concurrency, wrk counted 12 and 177 errors in two of eight c=64 runs;
// none in the two runs since, which is too few to say more).
func (b *bench) perIP() int {
	return 2 * max(64, slices.Max(b.o.concs))
}

func (b *bench) loadCA(dataDir string) error {
	if b.ca != nil {
		return nil
	}
	pem, err := os.ReadFile(filepath.Join(dataDir, "ca.pem"))
	if err != nil {
		return err
	}
	ca := x509.NewCertPool()
	if !ca.AppendCertsFromPEM(pem) {
		return errNoCA
	}
	b.ca = ca
	return nil
}

// errNoCA: the edge's ca.pem holds no certificate (yet).
var errNoCA = errors.New("edge ca.pem: no certificate")

// startAgent starts an agent for the backend under sub, dialing the edge
// at edgeAddr, and waits until the tunnel answers.
func (b *bench) startAgent(sub, edgeAddr string) (*proc, error) {
	ca := filepath.Join(b.dir, "edge", "ca.pem")
	local := strings.TrimPrefix(b.be.plain.URL, "http://")
	var args, env []string
	if b.o.self {
		env = []string{roleEnv + "=agent"}
		// The inspector is on, as the CLI runs the agent by default.
		args = []string{"-edge", edgeAddr, "-ca-file", ca, "-local", local, "-subdomain", sub,
			"-window", strconv.FormatUint(uint64(b.o.window), 10), "-inspect", freePort()}
		if b.o.profile != "" {
			args = append(args, "-cpuprofile", filepath.Join(b.o.profile, "agent-"+sub+".pprof"))
			if b.o.contention {
				args = append(args, "-contention")
			}
		}
	} else {
		args = []string{"http", local, "--edge", edgeAddr, "--ca-file", ca, "--subdomain", sub, "--log-format", "json"}
	}
	p, err := startProc("agent "+sub, b.bin, args, append(env, b.o.childEnv...), filepath.Join(b.dir, "agent-"+sub+".log"))
	if err != nil {
		return nil, err
	}
	t := b.tunnel("http", sub)
	c := t.client(1)
	defer c.CloseIdleConnections()
	if _, ok := waitOK(t, c, 15*time.Second, 5*time.Millisecond); !ok {
		p.kill()
		return nil, fmt.Errorf("agent %s: tunnel did not answer within 15s", sub)
	}
	return p, nil
}

// tunnel is the public URL of sub over scheme, dialed at the edge's address.
func (b *bench) tunnel(scheme, sub string) target {
	host := sub + "." + domain
	t := target{base: scheme + "://" + b.addrs[scheme], host: host}
	if scheme == "https" {
		t.tls = &tls.Config{ServerName: host, RootCAs: b.ca}
	}
	return t
}

// direct is the backend itself over scheme (tcp: the tcp phase's service).
func (b *bench) direct(scheme string) target {
	switch scheme {
	case "tcp":
		return target{base: "tcp://" + b.tcp.addr()}
	case "https":
		return target{base: b.be.tls.URL, tls: b.be.tls.Client().Transport.(*http.Transport).TLSClientConfig}
	}
	return target{base: b.be.plain.URL}
}

func (b *bench) add(r row) {
	b.rows = append(b.rows, r)
	logf("%-40s direct %-12s tunnel %-12s %s %s", r.name, r.direct, r.tunnel, r.ratio, r.verdict)
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "**short**"
}

func pct(x float64) string { return fmt.Sprintf("%.1f%%", 100*x) }

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/1e6) }

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// smallGETs measures rate and latency of small GETs, direct and tunnelled.
func (b *bench) smallGETs() error {
	for _, scheme := range b.o.schemes {
		for _, c := range b.o.concs {
			d, err := b.load(b.direct(scheme), scheme, c)
			if err != nil {
				return err
			}
			e0, a0 := b.edge.cpu(), b.agent.cpu()
			t, err := b.load(b.tunnel(scheme, mainSub), scheme, c)
			if err != nil {
				return err
			}
			e1, a1 := b.edge.cpu(), b.agent.cpu()
			if t.n == 0 || d.n == 0 {
				return fmt.Errorf("%s c=%d: no successful request (tunnel errors %d, direct errors %d)", scheme, c, t.errs, d.errs)
			}
			rate, p50 := loadRows(fmt.Sprintf("GET %s c=%d%s", strings.ToUpper(scheme), c, b.by(scheme)), d, t)
			ratio, added := t.rps()/d.rps(), t.p50-d.p50
			switch c {
			case 1:
				rate.target, rate.verdict = "≥ 30%", verdict(ratio >= 0.30)
				p50.target, p50.verdict = "≤ +0.150 ms", verdict(added <= 150*time.Microsecond)
			case 16:
				rate.target, rate.verdict = "≥ 35%", verdict(ratio >= 0.35)
			}
			b.add(rate)
			b.add(p50)
			b.add(row{name: fmt.Sprintf("GET %s c=%d p99", strings.ToUpper(scheme), c), direct: ms(d.p99), tunnel: ms(t.p99),
				ratio: "+" + ms(t.p99-d.p99)})
			if c == 16 {
				b.add(row{name: fmt.Sprintf("edge CPU per 10k GETs (%s c=16)", strings.ToUpper(scheme)), tunnel: per10k(e1-e0, t.n)})
				b.add(row{name: fmt.Sprintf("agent CPU per 10k GETs (%s c=16)", strings.ToUpper(scheme)), tunnel: per10k(a1-a0, t.n)})
			}
			b.add(row{name: fmt.Sprintf("load generator CPU per 10k GETs (%s c=%d%s)", strings.ToUpper(scheme), c, b.generator(scheme)),
				direct: per10k(d.genCPU, d.n), tunnel: per10k(t.genCPU, t.n)})
			for _, p := range b.peers {
				if err := b.peerGETs(p, scheme, c, d); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// load runs the small GETs of one row against t: by wrk for plain HTTP
// with -wrk, else by the bench's Go visitors.
func (b *bench) load(t target, scheme string, conc int) (loadResult, error) {
	if b.o.wrk != "" && scheme == "http" {
		return wrkGETs(b.o.wrk, b.o.wrkT, t, conc, b.o.dur)
	}
	return smallGETs(t, conc, b.o.dur), nil
}

// by names the load generator of scheme's rows when it is not the default.
func (b *bench) by(scheme string) string {
	if b.o.wrk != "" && scheme == "http" {
		return " (wrk)"
	}
	return ""
}

func (b *bench) generator(scheme string) string {
	if b.o.wrk != "" && scheme == "http" {
		return ", wrk"
	}
	return ", bench process: visitors and backend"
}

// loadRows are the req/s and p50 rows of t against the direct run d.
func loadRows(name string, d, t loadResult) (rate, p50 row) {
	rate = row{name: name + " req/s", direct: fmt.Sprintf("%.0f", d.rps()), tunnel: fmt.Sprintf("%.0f", t.rps()), ratio: pct(t.rps() / d.rps())}
	if t.errs > 0 {
		rate.tunnel += fmt.Sprintf(" (%d errors)", t.errs)
	}
	p50 = row{name: name + " p50", direct: ms(d.p50), tunnel: ms(t.p50), ratio: "+" + ms(t.p50-d.p50)}
	return rate, p50
}

func per10k(cpu time.Duration, n int) string {
	return fmt.Sprintf("%.2f s", cpu.Seconds()*10000/float64(n))
}

// peerGETs measures p as smallGETs measures the tunnel, against the same
// direct figures d.
func (b *bench) peerGETs(p *peer, scheme string, c int, d loadResult) error {
	pt, ok := p.targets[scheme]
	if !ok {
		return nil
	}
	cpu0 := p.cpu()
	t, err := b.load(pt, scheme, c)
	if err != nil {
		return fmt.Errorf("%s: %w", p.name, err)
	}
	cpu := p.cpu() - cpu0
	if t.n == 0 {
		return fmt.Errorf("%s %s c=%d: no successful request (%d errors)", p.name, scheme, c, t.errs)
	}
	rate, p50 := loadRows(fmt.Sprintf("%s: GET %s c=%d%s", p.name, strings.ToUpper(scheme), c, b.by(scheme)), d, t)
	b.add(rate)
	b.add(p50)
	if c == 16 {
		b.add(row{name: fmt.Sprintf("%s: CPU per 10k GETs, all its processes (%s c=16)", p.name, strings.ToUpper(scheme)), tunnel: per10k(cpu, t.n)})
	}
	return nil
}

// transfers measures 64 MiB downloads and uploads, direct and tunnelled.
func (b *bench) transfers() error {
	for _, scheme := range b.o.schemes {
		for _, dir := range []struct {
			name   string
			f      func(target, *http.Client, int64) (float64, error)
			target float64
		}{{"download", download, 0.5}, {"upload", upload, 0.6}} {
			rate := func(t target) (float64, error) {
				c := t.client(1)
				defer c.CloseIdleConnections()
				r, err := median(b.o.xfers, func() (float64, error) { return dir.f(t, c, b.o.size) })
				if err != nil {
					return 0, fmt.Errorf("%s %s: %w", scheme, dir.name, err)
				}
				return r, nil
			}
			direct, err := rate(b.direct(scheme))
			if err != nil {
				return err
			}
			name := fmt.Sprintf("%s %s %d MiB", strings.ToUpper(scheme), dir.name, b.o.size>>20)
			// CPU is steadier than throughput on a shared machine.
			gib := float64(b.o.xfers) * float64(b.o.size) / (1 << 30)
			e0, a0 := b.edge.cpu(), b.agent.cpu()
			var tunnel float64
			kinds, err := b.measureKinds("edge / agent", name, gib, []*proc{b.edge, b.agent}, func() (err error) {
				tunnel, err = rate(b.tunnel(scheme, mainSub))
				return err
			})
			if err != nil {
				return err
			}
			ratio := tunnel / direct
			b.add(row{name: name, direct: mibps(direct), tunnel: mibps(tunnel),
				ratio: pct(ratio), target: fmt.Sprintf("≥ %.0f%%", 100*dir.target), verdict: verdict(ratio >= dir.target)})
			b.add(row{name: "edge / agent CPU per GiB, " + name,
				tunnel: fmt.Sprintf("%.2f / %.2f s", (b.edge.cpu()-e0).Seconds()/gib, (b.agent.cpu()-a0).Seconds()/gib)})
			kinds()
			for _, p := range b.peers {
				pt, ok := p.targets[scheme]
				if !ok {
					continue
				}
				cpu0 := p.cpu()
				var r float64
				procs := p.schemeProcs(scheme)
				kinds, err := b.measureKinds(p.name+": "+procNames(procs), name, gib, procs, func() (err error) {
					r, err = rate(pt)
					return err
				})
				if err != nil {
					return fmt.Errorf("%s: %w", p.name, err)
				}
				b.add(row{name: p.name + ": " + name, direct: mibps(direct), tunnel: mibps(r), ratio: pct(r / direct)})
				b.add(row{name: p.name + ": CPU per GiB, all its processes, " + name, tunnel: fmt.Sprintf("%.2f s", (p.cpu()-cpu0).Seconds()/gib)})
				kinds()
			}
		}
	}
	return nil
}

func mibps(bytesPerSecond float64) string { return fmt.Sprintf("%.0f MiB/s", bytesPerSecond/(1<<20)) }

// peakRSS reports the high-water mark of resident memory of both children
// after the load phases, and what is resident then split into anonymous
// memory and file pages (most of them the binary's own, which the kernel
// can drop and read again).
func (b *bench) peakRSS() error {
	for _, p := range []*proc{b.edge, b.agent} {
		hwm := p.status("VmHWM")
		name := strings.Fields(p.name)[0]
		b.add(row{name: "peak RSS of " + name + " under load", tunnel: mib(hwm),
			target: "≤ 30 MiB", verdict: verdict(hwm <= 30<<20)})
		b.add(row{name: "RSS of " + name + " after load, anonymous / file pages", tunnel: anonFile(p)})
	}
	for _, p := range b.peers {
		for _, pr := range p.procs {
			b.add(row{name: fmt.Sprintf("%s: peak RSS of %s under load", p.name, pr.name), tunnel: mib(pr.status("VmHWM"))})
			b.add(row{name: fmt.Sprintf("%s: RSS of %s after load, anonymous / file pages", p.name, pr.name), tunnel: anonFile(pr)})
		}
	}
	return nil
}

func anonFile(p *proc) string {
	return mib(p.status("RssAnon")) + " / " + mib(p.status("RssFile"))
}

// resets measures the time from a reset of an agent's connection to the
// first successful request. The agent dials the edge through a proxy that
// can close every connection it carries.
func (b *bench) resets() error {
	px, err := newResetProxy(b.addrs["control"])
	if err != nil {
		return err
	}
	defer px.close()
	const sub = "reset"
	p, err := b.startAgent(sub, px.addr())
	if err != nil {
		return err
	}
	defer p.stop()
	t := b.tunnel("http", sub)
	c := t.client(1)
	defer c.CloseIdleConnections()
	var ds []time.Duration
	for range b.o.resets {
		if _, ok := waitOK(t, c, 10*time.Second, 5*time.Millisecond); !ok {
			return errors.New("tunnel not serving before a reset")
		}
		time.Sleep(200 * time.Millisecond)
		start := time.Now()
		px.reset()
		at, ok := waitOK(t, c, 60*time.Second, time.Millisecond)
		if !ok {
			return errors.New("tunnel not back within 60s of a reset")
		}
		ds = append(ds, at.Sub(start))
	}
	b.addRecovery("back after connection reset", ds, time.Second)
	return nil
}

// outages kills the edge, waits the outage, starts it again on the same
// ports and data directory, and measures the time to the first successful
// request; then the same for each peer with a server to restart.
func (b *bench) outages() error {
	ds, err := b.outageTimes(b.tunnel("http", mainSub), func() { b.edge.kill() }, b.startEdge)
	if err != nil {
		return fmt.Errorf("tunnel %w", err)
	}
	b.addRecovery(fmt.Sprintf("back after %s edge outage", b.o.outage), ds, 2*time.Second)
	for _, p := range b.peers {
		if p.restart == nil {
			continue
		}
		ds, err := b.outageTimes(p.targets["http"], func() { p.procs[0].kill() }, p.restart)
		if err != nil {
			return fmt.Errorf("%s %w", p.name, err)
		}
		slices.Sort(ds)
		b.add(row{name: fmt.Sprintf("%s: back after %s server outage (median of %d)", p.name, b.o.outage, len(ds)),
			tunnel: ms(ds[len(ds)/2]), ratio: fmt.Sprintf("min %s, max %s", ms(ds[0]), ms(ds[len(ds)-1]))})
	}
	return nil
}

// outageTimes runs the outages through t: kill, wait the outage, restart,
// and time the first successful request after the restart.
func (b *bench) outageTimes(t target, kill func(), restart func() error) ([]time.Duration, error) {
	c := t.client(1)
	defer c.CloseIdleConnections()
	var ds []time.Duration
	for range b.o.outages {
		if _, ok := waitOK(t, c, 30*time.Second, 5*time.Millisecond); !ok {
			return nil, errors.New("not serving before an outage")
		}
		kill()
		time.Sleep(b.o.outage)
		start := time.Now()
		if err := restart(); err != nil {
			return nil, err
		}
		at, ok := waitOK(t, c, 60*time.Second, time.Millisecond)
		if !ok {
			return nil, errors.New("not back within 60s of an outage")
		}
		ds = append(ds, at.Sub(start))
	}
	return ds, nil
}

func (b *bench) addRecovery(name string, ds []time.Duration, target time.Duration) {
	slices.Sort(ds)
	med := ds[len(ds)/2]
	b.add(row{name: fmt.Sprintf("%s (median of %d)", name, len(ds)), tunnel: ms(med),
		ratio:  fmt.Sprintf("min %s, max %s", ms(ds[0]), ms(ds[len(ds)-1])),
		target: "≤ " + target.String(), verdict: verdict(med <= target)})
}

// idleTunnels measures edge memory per idle tunnel: a fresh edge's resident
// memory before and after n in-process agents have bound.
func (b *bench) idleTunnels() error {
	b.agent.stop()
	b.agent = nil
	b.edge.stop()
	if err := b.startEdge(); err != nil {
		return err
	}
	time.Sleep(time.Second)
	before := b.edge.status("VmRSS")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var online atomic.Int64
	local := strings.TrimPrefix(b.be.plain.URL, "http://")
	const batch = 100
	for i := 0; i < b.o.tunnels; i++ {
		var once sync.Once
		cfg := agent.DefaultConfig()
		cfg.Edge, cfg.RootCAs, cfg.Local, cfg.Subdomain = b.addrs["control"], b.ca, local, fmt.Sprintf("idle%04d", i)
		cfg.InspectAddr = "" // thousands of agents in one process: one inspector is a process's
		cfg.OnStatus = func(s agent.Status) {
			if s.State == agent.StateOnline {
				once.Do(func() { online.Add(1) })
			}
		}
		a, err := agent.New(cfg, nil)
		if err != nil {
			return err
		}
		wg.Go(func() { a.Run(ctx) })
		if (i+1)%batch == 0 || i+1 == b.o.tunnels {
			if err := waitFor(30*time.Second, func() bool { return online.Load() == int64(i+1) }); err != nil {
				return fmt.Errorf("%d of %d agents online: %w", online.Load(), i+1, err)
			}
		}
	}
	time.Sleep(2 * time.Second)
	after := b.edge.status("VmRSS")
	if b.o.profile != "" {
		b.edge.cmd.Process.Signal(syscall.SIGUSR1)
		time.Sleep(time.Second)
	}
	per := (after - before) / int64(b.o.tunnels)
	b.add(row{name: fmt.Sprintf("edge memory per idle tunnel (%d agents)", b.o.tunnels),
		direct: "RSS " + mib(before), tunnel: fmt.Sprintf("%.1f KiB", float64(per)/1024),
		ratio: "RSS " + mib(after), target: "≤ 64 KiB", verdict: verdict(per <= 64<<10)})
	return nil
}

func waitFor(timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// print writes the machine, the command and the table as Markdown.
func (b *bench) print(w io.Writer) {
	fmt.Fprintf(w, "machine: %d cores, %s, %s %s/%s\n", runtime.NumCPU(), cpuModel(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
	fmt.Fprintf(w, "command: go run ./bench %s\n", strings.Join(os.Args[1:], " "))
	fmt.Fprintf(w, "children: %s\n\n", b.children())
	fmt.Fprintln(w, "| measurement | direct | tunnel | ratio / added | target | |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---|---|")
	for _, r := range b.rows {
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", r.name, r.direct, r.tunnel, r.ratio, r.target, r.verdict)
	}
}

func (b *bench) children() string {
	if !b.o.self {
		return "ngstone edge and ngstone http (separate processes)"
	}
	win := "mux default"
	if b.o.window > 0 {
		win = strconv.FormatUint(uint64(b.o.window), 10) + " bytes"
	}
	return "bench binary as edge and agent (separate processes), yamux stream window " + win
}

func cpuModel() string {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for _, l := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}
