package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/config"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/mux"
)

func newHTTPCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "http PORT | HOST:PORT | URL",
		Short: "Put a local HTTP service at a public URL",
		Long: `Put a local HTTP service at a public URL through an edge.

With --edge, the agent connects to that edge. Without it, ngstone starts an
embedded edge in this process for the domain localhost, so that
https://NAME.localhost:8443 (and http://NAME.localhost:8080) reach the local
service on this machine.

On a terminal, stdout is a live status screen, redrawn in place: the
state (and, while reconnecting, the attempt, the next try, since when, the
last error and what to do about it), the edge and its latency, the
inspector's URL, each "Forwarding URL -> LOCAL", connection counters and
the last requests; Ctrl+C stops. Off a terminal (or with
--console=false) the agent prints "Forwarding URL -> LOCAL" on stdout once
bound, and again after every rebind, and logs one line per change of state
on stderr. It reconnects on its own when the network or the edge drops, and
gets the same URL back.

The inspector (a web page of the last requests, with replay) and a local
API in ngrok's shape (GET /api/tunnels) listen on 127.0.0.1:4040, or the
next free port up to 4049; --inspect-addr to choose, --inspect=false to
turn them off. With --subdomain and --edge, an agent
started again on this machine is the same instance as the last one (its id
is kept in the user cache directory), so it takes its name back at once even
if the edge has not yet noticed that the last one is gone. Exit codes: 0
after Ctrl-C, 1 on an error, 2 on bad usage, 3 when the edge refuses the
token or the name, 4 when another agent took the name over.

Every flag is also an environment variable (NGSTONE_ + the flag in upper case,
'-' as '_', e.g. NGSTONE_AUTHTOKEN; NGSTONE_AUTHTOKEN_FILE reads it from a
file) and a key of the YAML settings file: --config FILE, or else the
default file that ngstone config writes (ngstone/ngstone.yml in the user
config directory, ~/.config on Linux), if it exists. Flags win over the
environment, the environment over the file. Several tunnels in one agent:
ngstone start.`,
		Args: httpArgs,
	}
	loader := config.NewAgent(cmd.Flags())
	if isTerminal(os.Stderr) {
		// Someone is watching: show each request, as ngrok's console does.
		cmd.Flags().Lookup("log-requests").DefValue = "true"
	}
	runWith(cmd, loader)
	return cmd
}

// runWith makes cmd run the agent of one tunnel that loader loads for the
// local address given.
func runWith(cmd *cobra.Command, loader *config.Agent) {
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		cfg, lc, err := loader.Load(args[0])
		if err != nil {
			return withCode(exitUsage, err)
		}
		return runLoaded(cmd, loader, cfg, lc)
	}
}

// runLoaded runs the agent cfg, which loader loaded, in the view its
// settings and the terminal call for: the console, or lines.
func runLoaded(cmd *cobra.Command, loader *config.Agent, cfg agent.Config, lc config.Log) error {
	cs, err := loader.Console()
	if err != nil {
		return withCode(exitUsage, err)
	}
	if !cs.Enabled || !isTerminal(os.Stdout) {
		log := newLogger(lc, os.Stderr)
		return runAgent(cmd.Context(), cfg, log, newStatusPrinter(cmd.OutOrStdout(), log))
	}
	// The console owns the terminal: while stderr is the same terminal,
	// the log's warnings are shown in it.
	var events *eventLog
	log := newLogger(lc, os.Stderr)
	if isTerminal(os.Stderr) {
		events = newEventLog(consoleEvents)
		log = newConsoleLogger(lc, events)
	}
	return runAgent(cmd.Context(), cfg, log, newConsoleView(version, events, cs.Refresh, isTerminal(os.Stdin)))
}

// agentView shows the agent's state while it runs: the console on a
// terminal, lines off one.
type agentView interface {
	// update is the agent's OnStatus.
	update(agent.Status)
	// setNote gives a line about the setup, shown once.
	setNote(string)
	// run runs a until ctx ends or it fails, and returns exitFor its error.
	run(ctx context.Context, a *agent.Agent) error
}

func runAgent(ctx context.Context, cfg agent.Config, log *slog.Logger, view agentView) error {
	if cfg.Edge == "" {
		e, err := startEmbeddedEdge(ctx, log, cfg.TCPTunnels())
		if err != nil {
			return withCode(exitError, err)
		}
		defer func() {
			// The agent has drained its exchanges; let the edge finish
			// writing their responses to visitors before it stops.
			sctx, cancel := context.WithTimeout(context.Background(), embeddedShutdown)
			defer cancel()
			e.Shutdown(sctx)
		}()
		cfg.Edge = e.Addr("control").String()
		cfg.CAFile = e.CAFile()
		view.setNote(fmt.Sprintf("Embedded edge for *.localhost; its CA is %s (curl --cacert %s, or trust it in your browser)", e.CAFile(), e.CAFile()))
	} else if cfg.AsksName() && cfg.InstanceID == "" {
		// A restarted agent is the same instance as the one before it
		// on this machine, and takes its names back at once.
		if dir, err := os.UserCacheDir(); err == nil {
			id, kept, release, err := agent.KeepInstance(filepath.Join(dir, "ngstone", "instances"), cfg)
			if err != nil {
				log.Warn("instance id not kept: a restarted agent will wait for the edge to give up on this one", "err", err)
			} else {
				defer release()
				cfg.InstanceID = id
				log.Debug("instance", "digest", mux.InstanceDigest(id), "kept_from_earlier_run", kept)
			}
		}
	}
	cfg.OnStatus = view.update
	a, err := agent.New(cfg, log)
	if err != nil {
		return withCode(exitUsage, err)
	}
	return view.run(ctx, a)
}

// exitFor gives the agent's final error its exit code and sentence.
func exitFor(err error) error {
	var re *agent.RefusedError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, agent.ErrEvicted):
		return withCode(exitEvicted, errors.New(takenBy(agent.EvictedBy(err))+" took over this tunnel's name while this one was unreachable; it no longer serves it"))
	case errors.As(err, &re):
		return withCode(exitRefused, fmt.Errorf("the edge refused the tunnel: %s: %s", re.Code, re.Message))
	}
	return withCode(exitError, err)
}

// exitCodeOf is the exit code err makes the process exit with.
func exitCodeOf(err error) int {
	var ce *codeError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ce):
		return ce.code
	}
	return exitUsage
}

// embeddedShutdown bounds the embedded edge's graceful stop after the agent
// returns.
const embeddedShutdown = 5 * time.Second

// Embedded edge addresses: fixed ports so the URL stays the same across
// runs, or any free port when they are taken.
var embeddedAddrs = map[string]string{"http": "127.0.0.1:8080", "https": "127.0.0.1:8443"}

// embeddedEdgeConfig is the embedded edge's configuration: `ngstone edge`'s
// defaults for the domain localhost, on loopback, with its CA in dataDir.
func embeddedEdgeConfig(dataDir string) edge.Config {
	cfg := edge.DefaultConfig()
	cfg.Domain = "localhost"
	cfg.HTTPAddr, cfg.HTTPSAddr = embeddedAddrs["http"], embeddedAddrs["https"]
	cfg.ControlAddr = "127.0.0.1:0"
	cfg.AdminAddr = ""
	cfg.TLS.DataDir = dataDir
	return cfg
}

// startEmbeddedEdge starts the embedded edge, with tcp free ports of
// loopback for TCP tunnels.
func startEmbeddedEdge(ctx context.Context, log *slog.Logger, tcp int) (*edge.Edge, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = os.TempDir()
	}
	cfg := embeddedEdgeConfig(filepath.Join(dir, "ngstone"))
	for try := 1; ; try++ {
		if cfg.TCPPorts, err = freeTCPPorts(tcp); err != nil {
			return nil, fmt.Errorf("embedded edge: %w", err)
		}
		// Not "component": the edge's parts (certs) set their own.
		e, err := edge.New(cfg, log.With("edge", "embedded"))
		if err != nil {
			return nil, err
		}
		err = e.Start(ctx)
		if err == nil {
			return e, nil
		}
		e.Close()
		if !errors.Is(err, syscall.EADDRINUSE) || try == embeddedTries {
			return nil, fmt.Errorf("embedded edge: %w", err)
		}
		// Another process has the port (an agent started beside this one):
		// any free one instead, for that address only.
		taken := addrOf(err)
		for _, a := range []*string{&cfg.HTTPAddr, &cfg.HTTPSAddr} {
			if *a == taken || taken == "" {
				*a = anyPort(*a)
			}
		}
	}
}

// freeTCPPorts returns n ports of loopback free now, for an embedded edge's
// TCP tunnels.
func freeTCPPorts(n int) ([]mux.PortRange, error) {
	var out []mux.PortRange
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		p := ln.Addr().(*net.TCPAddr).Port
		out = append(out, mux.PortRange{Lo: p, Hi: p})
	}
	return out, nil
}

// addrOf is the address a failed listen was for; empty if err names none.
func addrOf(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Addr != nil {
		return op.Addr.String()
	}
	return ""
}

// embeddedTries bounds the embedded edge's starts when its ports are
// taken between the look and the listen.
const embeddedTries = 3

// anyPort is addr's host with port 0: any free port.
func anyPort(addr string) string {
	host, _, _ := net.SplitHostPort(addr)
	return net.JoinHostPort(host, "0")
}

// statusPrinter shows the agent's state off a terminal: the Forwarding
// lines on stdout whenever it comes online (scripts read them), and one
// log line per change of state, or of what a person can do about it:
// nothing per reconnect attempt while the cause stays the same.
type statusPrinter struct {
	w    io.Writer
	log  *slog.Logger
	mu   sync.Mutex
	last agent.Status
}

func newStatusPrinter(w io.Writer, log *slog.Logger) *statusPrinter {
	return &statusPrinter{w: w, log: log}
}

func (p *statusPrinter) setNote(s string) { fmt.Fprintln(os.Stderr, s) }

func (p *statusPrinter) run(ctx context.Context, a *agent.Agent) error {
	return exitFor(a.Run(ctx))
}

func (p *statusPrinter) update(s agent.Status) {
	p.mu.Lock()
	defer p.mu.Unlock()
	prev := p.last
	p.last = s
	rebound := s.State == agent.StateOnline && (prev.State != agent.StateOnline || bindings(s) != bindings(prev))
	if !rebound && s.State == prev.State && s.Hint == prev.Hint && errClass(s.Err) == errClass(prev.Err) {
		return
	}
	p.logStatus(s)
	if rebound {
		for _, e := range s.Endpoints() {
			fmt.Fprintf(p.w, "Forwarding %s -> %s\n", e.PublicURL, e.Local)
		}
	}
}

// bindings is what s's tunnels hold, to tell a rebind from a repeat.
func bindings(s agent.Status) string {
	var b strings.Builder
	for _, t := range s.Tunnels {
		fmt.Fprintf(&b, "%s %s %d %s|", t.Name, t.URL, t.Generation, t.State)
	}
	return b.String()
}

// errClass is what tells two causes of a reconnect apart for the log: a
// changed hint or a changed kind of error is news, another attempt is not.
func errClass(err error) string {
	if err == nil {
		return ""
	}
	return fmt.Sprintf("%T", errors.Unwrap(err))
}

func (p *statusPrinter) logStatus(s agent.Status) {
	switch s.State {
	case agent.StateOnline:
		p.log.Info("online", "url", s.URL, "edge", s.Edge, "generation", s.Generation, "session", s.SessionID, "latency", s.Latency.Round(10*time.Microsecond))
	case agent.StateReconnecting:
		p.log.Warn("reconnecting", "attempt", s.Attempt, "in", time.Until(s.NextRetry).Round(time.Millisecond),
			"since", s.Since.Format(time.RFC3339), "cause", agent.ErrText(s.Err), "hint", s.Hint)
	case agent.StateEvicted:
		p.log.Error("evicted", "hostname", s.Hostname, "reason", s.EvictedReason, "by", takenBy(s.EvictedBy), "exit_code", exitEvicted)
	case agent.StateFailed:
		p.log.Error("refused", "err", agent.ErrText(s.Err), "exit_code", exitRefused)
	default:
		p.log.Info(string(s.State), "edge", s.Edge)
	}
}
