package main

import (
	"github.com/spf13/cobra"

	"github.com/ngstone/ngstone/config"
)

func newTLSCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "tls PORT | HOST:PORT",
		Short: "Pass TLS connections for a public name through to a local TLS service",
		Long: `Pass TLS connections for a public name through to a local service that
terminates TLS itself: the edge reads the name a visitor's ClientHello asks
for (SNI) on its HTTPS port and relays the whole connection, unopened, to
this agent, which relays it to the local service. The visitor sees the
local service's certificate; the edge never gets one for that name.

--subdomain NAME (NAME.DOMAIN) or --hostname H (a hostname of your own,
which the token must allow) chooses the name; without either, the edge
gives a random one. The name is bound like an HTTP tunnel's: the same
takeover rules, reconnects, --allow-cidr and --deny-cidr; a visitor over
plain HTTP gets 404 tunnel_not_found. The HTTP-only flags do not apply.
Every flag is also an environment variable and a key of the settings
file (see ngstone http --help).`,
		Args: httpArgs,
	}
	loader := config.NewTLSAgent(cmd.Flags())
	runWith(cmd, loader)
	return cmd
}
