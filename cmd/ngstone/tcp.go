package main

import (
	"github.com/spf13/cobra"

	"github.com/ngstone/ngstone/config"
)

func newTCPCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "tcp PORT | HOST:PORT",
		Short: "Put a local TCP service at a public port of the edge",
		Long: `Put a local TCP service (ssh, a database, a game server) at a public
port of an edge: tcp://DOMAIN:PORT. Each connection to that port reaches
the local service as it is, byte for byte, half-closes included.

The edge gives the tunnel a port of its --tcp-ports; --remote-port asks for
one. The port stays this token's: the edge keeps it for the token and this
local address (--tcp-port-reserve, 24h by default, after the last agent
leaves it), so an agent started again gets the same address, and no other
token can take it meanwhile. Without --edge, an embedded edge on this
machine serves a free port of 127.0.0.1.

--allow-cidr and --deny-cidr choose who may connect (others are closed at
once). The status, the local API (GET /api/tunnels, proto tcp) and the
exit codes are ngstone http's; its HTTP-only flags do not apply. Every flag
is also an environment variable (NGSTONE_REMOTE_PORT) and a key of the
settings file (see ngstone http --help).`,
		Args: httpArgs,
	}
	loader := config.NewTCPAgent(cmd.Flags())
	runWith(cmd, loader)
	return cmd
}
