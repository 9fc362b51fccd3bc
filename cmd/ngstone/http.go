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

The agent prints "Forwarding URL -> LOCAL" on stdout once bound, and again
after every rebind. It reconnects on its own when the network or the edge
drops, and gets the same URL back. With --subdomain and --edge, an agent
started again on this machine is the same instance as the last one (its id
is kept in the user cache directory), so it takes its name back at once even
if the edge has not yet noticed that the last one is gone. Exit codes: 0
after Ctrl-C, 1 on an error, 2 on bad usage, 3 when the edge refuses the
token or the name, 4 when another agent took the name over.

Every flag is also an environment variable (NGSTONE_ + the flag in upper case,
'-' as '_', e.g. NGSTONE_AUTHTOKEN; NGSTONE_AUTHTOKEN_FILE reads it from a
file) and a key of the YAML --config file.`,
		Args: cobra.ExactArgs(1),
	}
	loader := config.NewAgent(cmd.Flags())
	if isTerminal(os.Stderr) {
		// Someone is watching: show each request, as ngrok's console does.
		cmd.Flags().Lookup("log-requests").DefValue = "true"
	}
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		cfg, lc, err := loader.Load(args[0])
		if err != nil {
			return withCode(exitUsage, err)
		}
		log := newLogger(lc, os.Stderr)
		return runAgent(cmd.Context(), cfg, log, cmd.OutOrStdout())
	}
	return cmd
}

func runAgent(ctx context.Context, cfg agent.Config, log *slog.Logger, stdout io.Writer) error {
	if cfg.Edge == "" {
		e, err := startEmbeddedEdge(ctx, log)
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
		fmt.Fprintf(os.Stderr, "Embedded edge for *.localhost; its CA is %s (curl --cacert %s, or trust it in your browser)\n", e.CAFile(), e.CAFile())
	} else if (cfg.Subdomain != "" || cfg.Hostname != "") && cfg.InstanceID == "" {
		// A restarted agent is the same instance as the one before it
		// on this machine, and takes its name back at once.
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
	out := newStatusPrinter(stdout, log, isTerminal(os.Stdout))
	cfg.OnStatus = out.update
	a, err := agent.New(cfg, log)
	if err != nil {
		return withCode(exitUsage, err)
	}
	err = a.Run(ctx)
	var re *agent.RefusedError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, agent.ErrEvicted):
		return withCode(exitEvicted, errors.New("another agent took over this tunnel's name while this one was unreachable; it no longer serves it"))
	case errors.As(err, &re):
		return withCode(exitRefused, fmt.Errorf("the edge refused the tunnel: %s: %s", re.Code, re.Message))
	}
	return withCode(exitError, err)
}

// embeddedShutdown bounds the embedded edge's graceful stop after the agent
// returns.
const embeddedShutdown = 5 * time.Second

// Embedded edge addresses: fixed ports so the URL stays the same across
// runs, or any free port when they are taken.
var embeddedAddrs = map[string]string{"http": "127.0.0.1:8080", "https": "127.0.0.1:8443"}

func startEmbeddedEdge(ctx context.Context, log *slog.Logger) (*edge.Edge, error) {
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = os.TempDir()
	}
	cfg := edge.DefaultConfig()
	cfg.Domain = "localhost"
	cfg.ControlAddr = "127.0.0.1:0"
	cfg.AdminAddr = ""
	cfg.TLS.DataDir = filepath.Join(dir, "ngstone")
	cfg.HTTPAddr = freeOr(embeddedAddrs["http"])
	cfg.HTTPSAddr = freeOr(embeddedAddrs["https"])
	e, err := edge.New(cfg, log.With("component", "embedded-edge"))
	if err != nil {
		return nil, err
	}
	if err := e.Start(ctx); err != nil {
		return nil, fmt.Errorf("embedded edge: %w", err)
	}
	return e, nil
}

// freeOr returns addr if it can be bound now, else a free port on its host.
func freeOr(addr string) string {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		host, _, _ := net.SplitHostPort(addr)
		return net.JoinHostPort(host, "0")
	}
	ln.Close()
	return addr
}

// statusPrinter shows the agent's state: the Forwarding lines on stdout
// whenever it comes online; on a terminal a status block, otherwise one log
// line per change of state.
type statusPrinter struct {
	w    io.Writer
	log  *slog.Logger
	tty  bool
	mu   sync.Mutex
	last agent.Status
}

func newStatusPrinter(w io.Writer, log *slog.Logger, tty bool) *statusPrinter {
	return &statusPrinter{w: w, log: log, tty: tty}
}

func (p *statusPrinter) update(s agent.Status) {
	p.mu.Lock()
	defer p.mu.Unlock()
	changed := s.State != p.last.State || s.URL != p.last.URL || s.Generation != p.last.Generation || s.Attempt != p.last.Attempt
	p.last = s
	if !changed {
		return
	}
	if p.tty {
		p.block(s)
	} else {
		p.log.Info("status", "state", string(s.State), "url", s.URL, "attempt", s.Attempt, "err", agent.ErrText(s.Err))
	}
	if s.State == agent.StateOnline {
		for _, u := range s.URLs {
			fmt.Fprintf(p.w, "Forwarding %s -> %s\n", u, s.Local)
		}
	}
}

func (p *statusPrinter) block(s agent.Status) {
	var b strings.Builder
	fmt.Fprintf(&b, "\nngstone\n")
	fmt.Fprintf(&b, "  Status      %s\n", stateLine(s))
	fmt.Fprintf(&b, "  Instance    %s\n", s.InstanceID)
	if s.URL != "" {
		fmt.Fprintf(&b, "  URL         %s\n", s.URL)
	}
	if s.Err != nil && s.State != agent.StateOnline {
		fmt.Fprintf(&b, "  Last error  %s\n", s.Err)
	}
	os.Stderr.WriteString(b.String())
}

func stateLine(s agent.Status) string {
	switch s.State {
	case agent.StateReconnecting:
		return fmt.Sprintf("reconnecting (attempt %d, next in %s)", s.Attempt, time.Until(s.NextRetry).Round(100*time.Millisecond))
	case agent.StateEvicted:
		return "evicted: another agent now serves this name; this one stopped advertising it"
	case agent.StateOnline:
		return fmt.Sprintf("online (session %d, generation %d)", s.SessionID, s.Generation)
	}
	return string(s.State)
}
