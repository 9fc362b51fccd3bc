// Command bench measures ngstone against the same backend reached directly:
// small-GET rate and latency, 64 MiB transfers, memory and CPU of the edge
// and the agent, and the time back in service after a connection reset and
// after an edge outage. The edge and the agent run as child processes (the
// ngstone binary, built on start), the visitors and the backend in this one;
// everything talks over loopback.
//
//	go run ./bench            # the full run, a few minutes
//	go run ./bench -quick     # a fast, rougher run
//	go run ./bench -self -window 262144 -profile /tmp/prof -phases get
//	go run ./bench -frp /tmp/frp -floor  # also frp, and two bare TCP relays
//	go run ./bench -muxfloor             # also two relays over ngstone's TLS+yamux link
//	go run ./bench -httpfloor -muxfloor  # also net/http on both ends of that link, and nothing else
//	go run ./bench -wan -frp /tmp/frp    # over emulated WAN links (root), frp beside
//	go run ./bench -wan -windows 1M,4M -wanphases xfer,behind  # stream windows against each other
//	go run ./bench -wrk wrk -phases get  # plain HTTP small GETs sent by wrk
//	go run ./bench -phases tcp -frp /tmp/frp -floor -muxfloor  # TCP tunnels: transfers, connect to first byte
//
// It prints a Markdown table on stdout and its progress on stderr.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ngstone/ngstone/internal/wan"
)

type options struct {
	quick      bool
	dur        time.Duration
	concs      []int
	size       int64
	xfers      int
	tunnels    int
	resets     int
	outages    int
	outage     time.Duration
	bin        string
	self       bool
	window     uint
	profile    string
	phases     map[string]bool
	keepTemp   bool
	childEnv   []string
	schemes    []string
	frp        string
	floor      bool
	muxFloor   bool
	httpFloor  bool
	contention bool
	cpuKinds   bool
	wrk        string // wrk's binary for the plain HTTP small GETs; empty: the Go visitors
	wrkT       int    // wrk's threads

	// The WAN bench (wan.go).
	wan           bool
	wanProfiles   []wan.Profile
	windows       []uint
	wanPhases     map[string]bool
	wanSize       int64
	wanXfers      int
	blackhole     time.Duration
	blackholes    int
	outageProfile string

	// -tracecount (tracecount.go).
	traceCount, traceUnit string
}

func main() {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(runRole(role, os.Args[1:]))
	}
	o := parseFlags()
	if o.traceCount != "" {
		if err := traceCount(os.Stdout, o.traceCount, o.traceUnit); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	raiseNoFile()
	if o.wan {
		if err := runWAN(o); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	b, err := newBench(o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	err = b.run()
	b.close()
	b.print(os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func parseFlags() options {
	var o options
	var concs, phases string
	var size int
	flag.BoolVar(&o.quick, "quick", false, "a fast run: shorter load, fewer transfers, resets, outages and tunnels")
	flag.DurationVar(&o.dur, "duration", 3*time.Second, "length of each small-GET run")
	flag.StringVar(&concs, "conc", "1,16,64", "visitor concurrencies for small GETs")
	flag.IntVar(&size, "size", 64, "transfer body size in MiB")
	flag.IntVar(&o.xfers, "xfers", 5, "transfers per direction and path (median)")
	flag.IntVar(&o.tunnels, "tunnels", 1000, "idle tunnels for edge memory per tunnel")
	flag.IntVar(&o.resets, "resets", 10, "connection resets (median)")
	flag.IntVar(&o.outages, "outages", 10, "edge outages (median)")
	flag.DurationVar(&o.outage, "outage", 3*time.Second, "length of each edge outage")
	flag.StringVar(&o.bin, "ngstone", "", "ngstone binary to run (default: build ./cmd/ngstone into a temporary directory); with -wan, several separated by commas are measured side by side")
	flag.BoolVar(&o.self, "self", false, "run the edge and agent from this binary (same packages), which allows -window and -profile")
	flag.UintVar(&o.window, "window", 0, "yamux stream window in bytes for -self (0: the mux default)")
	flag.StringVar(&o.profile, "profile", "", "with -self: write CPU profiles of the edge and agent into this directory (and of the HTTP floor's sides, with -httpfloor)")
	flag.StringVar(&phases, "phases", "get,xfer,reset,outage,idle", "phases to run (and grpc: unary gRPC calls through an http2 tunnel; tcp: a TCP tunnel's transfers and connection setup)")
	flag.BoolVar(&o.keepTemp, "keep", false, "keep the temporary directory (child logs)")
	flag.StringVar(&o.frp, "frp", "", "also measure frp: a directory holding frps and frpc binaries (GET and transfer phases, HTTP)")
	flag.BoolVar(&o.floor, "floor", false, "also measure the floor: two plain TCP relay processes in front of the backend (GET and transfer phases)")
	flag.BoolVar(&o.httpFloor, "httpfloor", false, "also measure the HTTP floor: the mux floor's link with net/http's server, reverse proxy and transport on each side, as ngstone's request path has them, and nothing else (GET and transfer phases, HTTP)")
	flag.BoolVar(&o.muxFloor, "muxfloor", false, "also measure the mux floor: two relay processes with ngstone's TLS and yamux link between them, a stream per visitor connection, no HTTP (GET and transfer phases)")
	flag.BoolVar(&o.wan, "wan", false, "run the WAN bench instead: edge and agent in two network namespaces joined by an emulated link (root)")
	profiles := flag.String("profiles", profileNames(), "WAN: the links to measure over")
	windows := flag.String("windows", "", "WAN: run the bench binary as edge and agent once for each of these stream windows (e.g. 1M,4M) instead of ngstone's default")
	wanPhases := flag.String("wanphases", "xfer,behind,outage", "WAN: phases to run")
	wanSize := flag.Int("wansize", 20, "WAN: transfer size in MiB")
	flag.IntVar(&o.wanXfers, "wanxfers", 3, "WAN: transfers per direction (median)")
	flag.DurationVar(&o.blackhole, "blackhole", 30*time.Second, "WAN: length of each black-hole of the link")
	flag.IntVar(&o.blackholes, "blackholes", 5, "WAN: black-holes per tunnel (median)")
	flag.StringVar(&o.outageProfile, "outageprofile", "50ms", "WAN: the link the outage phase runs over")
	flag.BoolVar(&o.cpuKinds, "cpukinds", false, "for each transfer, also split the CPU per GiB of the edge and agent (and of each peer's processes) by kind: crypto, copies, switches, the kernel's TCP, the rest (samples taken with perf, which must be on PATH)")
	flag.BoolVar(&o.contention, "contention", false, "with -profile: also write mutex and block profiles of the edge and agent (DIR/ROLE-mutex.pprof, -block.pprof); their sampling costs CPU")
	flag.StringVar(&o.wrk, "wrk", "", "send the plain HTTP small GETs with this wrk binary (e.g. wrk, from PATH) instead of the bench's own Go visitors, which share the cores with what they measure")
	flag.IntVar(&o.wrkT, "wrkthreads", 1, "wrk's threads with -wrk")
	schemes := flag.String("schemes", "http,https", "visitor schemes for the GET and transfer phases")
	childEnv := flag.String("childenv", "", "extra environment for the edge and agent, KEY=VALUE separated by commas (e.g. GOMAXPROCS=1)")
	flag.StringVar(&o.traceCount, "tracecount", "", "print, per exchange, the goroutines started, waits and syscalls in this execution trace (one a role wrote on SIGUSR2), and exit")
	flag.StringVar(&o.traceUnit, "traceunit", `^Waiting->Runnable (?s:.*)yamux\.\(\*Session\)\.incomingStream|^NotExist->Runnable (?s:.*)net/http\.\(\*connReader\)\.startBackgroundRead`, "with -tracecount: a step every exchange takes once, a regular expression matched against each goroutine state transition as FROM->TO and its stacks; the counts are divided by its matches")
	flag.Parse()
	o.schemes = strings.Split(*schemes, ",")
	if *childEnv != "" {
		o.childEnv = strings.Split(*childEnv, ",")
	}
	o.size = int64(size) << 20
	for _, c := range strings.Split(concs, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(c))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "bench: -conc %q: want positive integers\n", concs)
			os.Exit(2)
		}
		o.concs = append(o.concs, n)
	}
	o.phases = map[string]bool{}
	for _, p := range strings.Split(phases, ",") {
		o.phases[strings.TrimSpace(p)] = true
	}
	if o.quick {
		o.dur = min(o.dur, time.Second)
		o.xfers = min(o.xfers, 3)
		o.tunnels = min(o.tunnels, 200)
		o.resets = min(o.resets, 5)
		o.outages = min(o.outages, 3)
	}
	if o.profile != "" {
		o.self = true
	}
	if o.cpuKinds {
		if err := checkPerf(); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(2)
		}
	}
	o.wanSize = int64(*wanSize) << 20
	o.wanPhases = map[string]bool{}
	for _, p := range strings.Split(*wanPhases, ",") {
		o.wanPhases[strings.TrimSpace(p)] = true
	}
	for _, name := range strings.Split(*profiles, ",") {
		p, ok := wan.ProfileByName(strings.TrimSpace(name))
		if !ok {
			fmt.Fprintf(os.Stderr, "bench: -profiles: no profile %q (%s)\n", name, profileNames())
			os.Exit(2)
		}
		o.wanProfiles = append(o.wanProfiles, p)
	}
	for _, w := range strings.Split(*windows, ",") {
		if w = strings.TrimSpace(w); w == "" {
			continue
		}
		n, err := parseSize(w)
		if err != nil || n < 256<<10 {
			fmt.Fprintf(os.Stderr, "bench: -windows %q: want sizes of at least 256K (e.g. 1M,4M)\n", w)
			os.Exit(2)
		}
		o.windows = append(o.windows, n)
	}
	return o
}

func profileNames() string {
	var names []string
	for _, p := range wan.Profiles {
		names = append(names, p.Name)
	}
	return strings.Join(names, ",")
}

// parseSize reads a byte count with an optional K or M suffix (KiB, MiB).
func parseSize(s string) (uint, error) {
	mult := uint(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	}
	n, err := strconv.ParseUint(s, 10, 32)
	return uint(n) * mult, err
}

// build compiles the ngstone binary into dir.
func build(dir string) (string, error) {
	out := filepath.Join(dir, "ngstone")
	cmd := exec.Command("go", "build", "-o", out, "github.com/ngstone/ngstone/cmd/ngstone")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("build ngstone: %w", err)
	}
	return out, nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
}
