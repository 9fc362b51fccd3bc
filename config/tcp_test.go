package config_test

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/config"
	"github.com/ngstone/ngstone/mux"
)

// TestTCPSettings: `ngstone tcp` takes --remote-port from a flag or the
// environment, a TCP tunnel of the tunnels: file its remote-port, and the
// edge its ports and their reserve.
func TestTCPSettings(t *testing.T) {
	clearNgstoneEnv(t)
	fs := pflag.NewFlagSet("tcp", pflag.ContinueOnError)
	c := config.NewTCPAgent(fs)
	fs.Parse([]string{"--edge", "e:4443", "--remote-port", "20022"})
	cfg, _, err := c.Load("22")
	if err != nil || cfg.Proto != agent.ProtoTCP || cfg.RemotePort != 20022 || cfg.Local != "22" {
		t.Fatalf("ngstone tcp 22 --remote-port 20022: %v %+v", err, cfg.Tunnel)
	}
	t.Setenv("NGSTONE_REMOTE_PORT", "20023")
	fs = pflag.NewFlagSet("tcp", pflag.ContinueOnError)
	c = config.NewTCPAgent(fs)
	fs.Parse([]string{"--edge", "e:4443"})
	if cfg, _, err := c.Load("localhost:5432"); err != nil || cfg.RemotePort != 20023 {
		t.Fatalf("NGSTONE_REMOTE_PORT: %v %+v", err, cfg.Tunnel)
	}
	fs = pflag.NewFlagSet("tcp", pflag.ContinueOnError)
	c = config.NewTCPAgent(fs)
	fs.Parse([]string{"--edge", "e:4443", "--basic-auth", "a:bbbbbbbbbb"})
	if _, _, err := c.Load("22"); err == nil || !strings.Contains(err.Error(), "basic-auth") {
		t.Fatalf("ngstone tcp --basic-auth: %v, want it refused", err)
	}
	if _, err := loadTunnels(t, writeFile(t, "tunnels:\n  ssh:\n    proto: tcp\n    addr: 22\n"), nil, true); err == nil || !strings.Contains(err.Error(), "remote-port") {
		t.Fatalf("ngstone start with NGSTONE_REMOTE_PORT: %v, want it refused", err)
	}
	os.Unsetenv("NGSTONE_REMOTE_PORT")

	cfg, err = loadTunnels(t, writeFile(t, "edge: e:4443\ntunnels:\n  ssh:\n    proto: tcp\n    addr: 22\n    remote_port: 20022\n    allow-cidr: [192.0.2.0/24]\n  web:\n    addr: 3000\n"), nil, true)
	if err != nil {
		t.Fatal(err)
	}
	ssh, web := cfg.Tunnels[0], cfg.Tunnels[1]
	if ssh.Proto != agent.ProtoTCP || ssh.RemotePort != 20022 || !slices.Equal(ssh.AllowCIDR, []string{"192.0.2.0/24"}) || web.Proto != "" {
		t.Fatalf("tunnels: ssh %+v, web %+v", ssh, web)
	}

	e, err := loadEdge(t, "--domain", "example.org", "--tcp-ports", "20000-20009,22022", "--tcp-port-reserve", "1h")
	if err != nil {
		t.Fatal(err)
	}
	ecfg, _, err := e.Load()
	if err != nil || !slices.Equal(ecfg.TCPPorts, []mux.PortRange{{Lo: 20000, Hi: 20009}, {Lo: 22022, Hi: 22022}}) || ecfg.TCPPortReserve != time.Hour {
		t.Fatalf("edge --tcp-ports: %v %v %s", err, ecfg.TCPPorts, ecfg.TCPPortReserve)
	}
	e, _ = loadEdge(t, "--domain", "example.org", "--tcp-ports", "20009-20000")
	if _, _, err := e.Load(); err == nil || !strings.Contains(err.Error(), "tcp-ports") {
		t.Fatalf("--tcp-ports 20009-20000: %v, want it refused", err)
	}

	pol, err := config.ParseTokens([]byte("tokens:\n  - token: t1\n    tcp_ports: [22022, \"20000-20009\"]\n"))
	if err != nil || !slices.Equal(pol[0].TCPPorts, []string{"22022", "20000-20009"}) {
		t.Fatalf("tcp_ports: %v %+v", err, pol)
	}
	if _, err := config.ParseTokens([]byte("tokens:\n  - token: t1\n    tcp_ports: [\"20000-\"]\n")); err == nil || !strings.Contains(err.Error(), "tcp_ports") {
		t.Fatalf("a bad tcp_ports: %v, want it refused", err)
	}
}
