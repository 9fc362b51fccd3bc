package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"strings"
	"syscall"
	"time"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/edge"
)

// roleEnv names the environment variable under which the bench binary runs
// as a child edge or agent (with -self): the same packages the ngstone
// binary runs, plus a CPU profile and a yamux stream window of choice; and
// as a relay of the floor (-floor) and a side of the mux floor (-muxfloor)
// or of the HTTP floor (-httpfloor).
const roleEnv = "NGSTONE_BENCH_ROLE"

// runRole runs the edge, the agent, a floor relay or a side of the mux or
// HTTP floor until SIGTERM; it returns the exit code.
func runRole(role string, args []string) int {
	fs := flag.NewFlagSet(role, flag.ExitOnError)
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile here")
	window := fs.Uint("window", 0, "yamux stream window in bytes (0: the default)")
	domain := fs.String("domain", "", "edge: domain")
	httpAddr := fs.String("http-addr", "", "edge: HTTP listener")
	httpsAddr := fs.String("https-addr", "", "edge: HTTPS listener")
	ctrlAddr := fs.String("control-addr", "", "edge: control listener")
	dataDir := fs.String("data-dir", "", "edge: data dir")
	edgeAddr := fs.String("edge", "", "agent: edge control address")
	caFile := fs.String("ca-file", "", "agent: CA file")
	serverName := fs.String("server-name", "", "agent: the name the edge's certificate must match")
	local := fs.String("local", "", "agent: local service")
	sub := fs.String("subdomain", "", "agent: subdomain")
	protocol := fs.String("upstream-protocol", "", "agent: http1 or http2 to the local service")
	listen := fs.String("listen", "", "relay: listen address")
	to := fs.String("to", "", "relay, mux agent: next hop")
	tunnel := fs.String("tunnel", "", "mux edge: tunnel listener")
	contention := fs.Bool("contention", false, "with -cpuprofile: also write mutex and block profiles (their sampling costs CPU)")
	inspect := fs.String("inspect", "", "agent: the inspector's address, as the CLI runs it by default (empty: none)")
	perIP := fs.Int("max-requests-per-ip", 0, "edge: requests in flight from one visitor address (0: the default)")
	fs.Parse(args)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer f.Close()
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
		if *contention {
			// Who waits on a lock or a channel, and for how long: one
			// contention event in 5, blocking events of a microsecond or
			// more.
			runtime.SetMutexProfileFraction(5)
			runtime.SetBlockProfileRate(1000)
			defer writeProfiles(strings.TrimSuffix(*cpuprofile, ".pprof"), "mutex", "block")
		}
		dumpOnUSR1(filepath.Dir(*cpuprofile), role)
		traceOnUSR2(filepath.Dir(*cpuprofile), role)
	}
	var err error
	switch role {
	case "edge":
		cfg := edge.DefaultConfig()
		cfg.Domain, cfg.HTTPAddr, cfg.HTTPSAddr, cfg.ControlAddr, cfg.AdminAddr = *domain, *httpAddr, *httpsAddr, *ctrlAddr, ""
		cfg.TLS = certs.Config{Mode: certs.ModeSelfSigned, DataDir: *dataDir}
		cfg.Mux.StreamWindow = uint32(*window)
		if *perIP > 0 {
			cfg.MaxRequestsPerIP = *perIP
		}
		// The idle phase's agents all come from 127.0.0.1.
		cfg.MaxAgentConnsPerIP = 0
		var e *edge.Edge
		if e, err = edge.New(cfg, nil); err == nil {
			err = e.Run(ctx)
		}
	case "agent":
		cfg := agent.DefaultConfig()
		cfg.Edge, cfg.CAFile, cfg.Local, cfg.Subdomain, cfg.ServerName = *edgeAddr, *caFile, *local, *sub, *serverName
		if *protocol != "" {
			cfg.UpstreamProtocol = *protocol
		}
		cfg.InspectAddr = *inspect
		cfg.Mux.StreamWindow = uint32(*window)
		var a *agent.Agent
		if a, err = agent.New(cfg, nil); err == nil {
			err = a.Run(ctx)
		}
	case "relay":
		err = runRelay(ctx, *listen, *to)
	case "muxedge":
		err = runFloorEdge(ctx, *listen, *tunnel, *dataDir, muxEdge)
	case "muxagent":
		err = runFloorAgent(ctx, *edgeAddr, *to, muxAgent)
	case "httpedge":
		err = runFloorEdge(ctx, *listen, *tunnel, *dataDir, httpEdge)
	case "httpagent":
		err = runFloorAgent(ctx, *edgeAddr, *to, httpAgent)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// writeProfiles writes the named profiles as PREFIX-NAME.pprof.
func writeProfiles(prefix string, names ...string) {
	for _, name := range names {
		f, err := os.Create(prefix + "-" + name + ".pprof")
		if err != nil {
			continue
		}
		pprof.Lookup(name).WriteTo(f, 0)
		f.Close()
	}
}

// dumpOnUSR1 writes heap and goroutine profiles into dir on each SIGUSR1.
func dumpOnUSR1(dir, role string) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	go func() {
		for range ch {
			writeMemStats(filepath.Join(dir, role+"-memstats.txt"))
			runtime.GC()
			for _, name := range []string{"heap", "goroutine"} {
				f, err := os.Create(filepath.Join(dir, role+"-"+name+".pprof"))
				if err != nil {
					continue
				}
				pprof.Lookup(name).WriteTo(f, 0)
				f.Close()
			}
		}
	}()
}

// writeMemStats writes where the process's memory is, as the runtime
// and the kernel count it, before the collection the heap profile forces:
// what of the resident set is heap in use, heap kept but free, stacks and
// the runtime's own.
func writeMemStats(path string) {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	status, _ := os.ReadFile("/proc/self/status")
	var b strings.Builder
	fmt.Fprintf(&b, "goroutines %d\nSys %d\nHeapSys %d\nHeapInuse %d\nHeapIdle %d\nHeapReleased %d\nStackInuse %d\nStackSys %d\nMSpanSys %d\nGCSys %d\nOtherSys %d\nNextGC %d\n",
		runtime.NumGoroutine(), m.Sys, m.HeapSys, m.HeapInuse, m.HeapIdle, m.HeapReleased, m.StackInuse, m.StackSys, m.MSpanSys, m.GCSys, m.OtherSys, m.NextGC)
	for line := range strings.Lines(string(status)) {
		if f := strings.Fields(line); len(f) > 1 && (strings.HasPrefix(f[0], "Vm") || strings.HasPrefix(f[0], "Rss")) {
			fmt.Fprintf(&b, "%s %s\n", strings.TrimSuffix(f[0], ":"), strings.Join(f[1:], " "))
		}
	}
	os.WriteFile(path, []byte(b.String()), 0o644)
}

// traceOnUSR2 writes an execution trace of the next traceWindow into
// dir/ROLE-N.trace on each SIGUSR2: which goroutines one exchange wakes,
// and where it blocks (go tool trace).
func traceOnUSR2(dir, role string) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR2)
	go func() {
		n := 0
		for range ch {
			n++
			f, err := os.Create(filepath.Join(dir, fmt.Sprintf("%s-%d.trace", role, n)))
			if err != nil {
				continue
			}
			if trace.Start(f) == nil {
				time.Sleep(traceWindow)
				trace.Stop()
			}
			f.Close()
		}
	}()
}

// traceWindow is how long one trace on SIGUSR2 runs.
const traceWindow = time.Second
