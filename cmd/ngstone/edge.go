package main

import (
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/ngstone/ngstone/config"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/registry"
)

func newEdgeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "edge --domain DOMAIN",
		Short: "Run the public edge server",
		Long: `Run the public edge server: visitors reach NAME.DOMAIN over HTTP(S), agents
connect to --control-addr over TLS.

Several edges share one registry with --cluster-etcd: an agent may connect
to any of them, and a visitor's request reaching another edge is forwarded
one hop to the agent's edge over --cluster-addr.

Every flag is also an environment variable (NGSTONE_ + the flag in upper case,
'-' as '_', e.g. NGSTONE_DRAIN_TIMEOUT) and a key of the YAML --config file.
Precedence: flags, environment, file, defaults.`,
		Args: cobra.NoArgs,
	}
	loader := config.NewEdge(cmd.Flags())
	groupFlagsInHelp(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		cfg, lc, err := loader.Load()
		if err != nil {
			return withCode(exitUsage, err)
		}
		log := newLogger(lc, os.Stderr)
		cfg.Version, cfg.Commit = version, buildCommit()
		if err := joinCluster(&cfg, loader, log); err != nil {
			return withCode(exitUsage, err)
		}
		if cfg.Cluster == nil {
			if err := keepRegistry(&cfg); err != nil {
				return withCode(exitError, err)
			}
		}
		e, err := edge.New(cfg, log)
		if err != nil {
			return withCode(exitUsage, err)
		}
		stopHUP := reloadOnHUP(e)
		defer stopHUP()
		return withCode(exitError, e.Run(cmd.Context()))
	}
	return cmd
}

// joinCluster fills cfg.Cluster from the --cluster-* settings. Without
// --cluster-etcd it does nothing.
func joinCluster(cfg *edge.Config, loader *config.Edge, log *slog.Logger) error {
	cl, err := loader.Cluster()
	if err != nil || len(cl.Endpoints) == 0 {
		return err
	}
	tc, err := cl.EtcdTLS(log)
	if err != nil {
		return err
	}
	cfg.Cluster = &edge.ClusterConfig{
		Store: registry.NewEtcd(registry.EtcdConfig{Endpoints: cl.Endpoints, TLS: tc,
			Username: cl.Username, Password: cl.Password, Prefix: cl.Prefix, Node: cl.Node,
			LeaseTTL: cl.LeaseTTL, RouteStaleness: cl.RouteStaleness, Log: log}),
		Addr: cl.Addr, Advertise: cl.Advertise, Key: cl.Key,
	}
	return nil
}

// registryFile is the single edge's registry in --data-dir.
const registryFile = "registry.db"

// keepRegistry has an edge that runs alone keep its bindings in --data-dir,
// so that a restart forgets no name's owner. The edge opens the file as it
// starts: one it may not read and write, or cannot create, stops it there,
// never a fallback to memory that a restart would forget.
func keepRegistry(cfg *edge.Config) error {
	dir := cfg.TLS.DataDir
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("data-dir %s: %w (the edge keeps its registry there)", dir, err)
	}
	cfg.RegistryFile = filepath.Join(dir, registryFile)
	return nil
}

// reloadOnHUP reloads file certificates on SIGHUP until the returned stop.
func reloadOnHUP(e *edge.Edge) func() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-ch:
				e.ReloadCertificates()
			case <-done:
				return
			}
		}
	}()
	return func() { signal.Stop(ch); close(done) }
}
