package main

import (
	"errors"
	"os"

	"github.com/spf13/cobra"

	"github.com/ngstone/ngstone/config"
)

func newStartCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "start NAME... | --all",
		Short: "Run the tunnels of the settings file, several in one agent",
		Long: `Run the tunnels named in the tunnels: section of the settings file (--config,
or the default file that ngstone config writes), or every one with --all,
in one agent: one session to the edge, one instance.

	edge: tunnels.example.com:4443
	authtoken: tok_...
	tunnels:
	  web:
	    addr: 3000                     # PORT, HOST:PORT or URL (required)
	    subdomain: web
	  api:
	    addr: https://localhost:8443
	    subdomain: api
	    upstream-insecure: true
	    basic-auth: ["alice:correct horse"]

An entry's keys are addr and the per-tunnel flags of ngstone http:
subdomain, hostname, host-header, basic-auth, allow-cidr, deny-cidr,
request-header-add, request-header-remove, response-header-add,
response-header-remove, upstream-timeout, upstream-ca-file,
upstream-insecure, upstream-protocol. What an entry does not set comes from
the flags, environment and the file's top level, as for ngstone http.

Each name is bound, taken back and given up on its own: after a reconnect
every name comes back at once; a name refused by the edge or taken over by
another agent leaves the others serving (the console and the log say
which). Ctrl-C releases them all. A restarted ngstone start with --edge is
the same instance as the last one and takes every name back at once. Exit
codes: 0 after Ctrl-C, 1 on an error, 2 on bad usage or a bad file, and
only when no tunnel is left: 3 when the edge refused them, 4 when another
agent took one over.`,
	}
	loader := config.NewAgent(cmd.Flags())
	if isTerminal(os.Stderr) {
		cmd.Flags().Lookup("log-requests").DefValue = "true"
	}
	all := cmd.Flags().Bool("all", false, "start every tunnel of the file")
	cmd.Args = func(_ *cobra.Command, args []string) error {
		switch {
		case *all && len(args) > 0:
			return withCode(exitUsage, errors.New("give tunnel names or --all, not both"))
		case !*all && len(args) == 0:
			return withCode(exitUsage, errors.New("missing NAME: give the tunnels of the file to start, e.g. `ngstone start web api`, or --all"))
		}
		return nil
	}
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		cfg, lc, err := loader.LoadTunnels(args, *all)
		if err != nil {
			return withCode(exitUsage, err)
		}
		return runLoaded(cmd, loader, cfg, lc)
	}
	return cmd
}
