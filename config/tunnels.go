package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"

	"github.com/spf13/cast"
	"github.com/spf13/viper"
	"go.yaml.in/yaml/v3"

	"github.com/ngstone/ngstone/agent"
)

// The settings file's tunnels: section is a map from a tunnel's name to
// its settings, as ngrok's file has it:
//
//	tunnels:
//	  web:
//	    addr: 3000            # PORT, HOST:PORT or URL (required)
//	    subdomain: web
//	  api:
//	    addr: https://localhost:8443
//	    hostname: api.example.org
//	    upstream-insecure: true
//	    basic-auth: ["alice:correct horse"]
//	  ssh:
//	    proto: tcp
//	    addr: 22
//	    remote-port: 20022    # optional: the edge keeps one for the tunnel
//	  mqtt:
//	    proto: tls            # passed through by SNI: the local service has the certificate
//	    addr: 8883
//	    subdomain: mqtt
//
// An entry's other keys are the agent's per-tunnel flags (tunnelKeys;
// ngrok's spelling with '_' is read too); what an entry does not set comes
// from the command's flags, environment and the file's top level, but the
// name it asks for, which is each tunnel's own. `proto` is http (the
// default), tcp or tls.

// errNoTunnels: `ngstone start` without a file, or a file without tunnels.
var errNoTunnels = errors.New("no tunnels")

// LoadTunnels reads the agent's settings and the tunnels of the settings
// file that names selects (all: every one), for `ngstone start`.
func (c *Agent) LoadTunnels(names []string, all bool) (agent.Config, Log, error) {
	cfg, lg, err := c.load()
	if err != nil {
		return cfg, lg, err
	}
	file := c.l.file
	if file == "" {
		where := "the default file, which `ngstone config` writes"
		if p, err := DefaultFile(); err == nil {
			where = p + " (`ngstone config` writes it)"
		}
		return cfg, lg, fmt.Errorf("%w: ngstone start runs the tunnels: of a settings file; give --config FILE, or put them in %s", errNoTunnels, where)
	}
	if cfg.Subdomain != "" || cfg.Hostname != "" || cfg.RemotePort != 0 {
		return cfg, lg, errors.New("subdomain, hostname, remote-port: each tunnel asks for its own name, in its entry of the tunnels: section")
	}
	entries, err := readTunnelEntries(file)
	if err != nil {
		return cfg, lg, err
	}
	if len(entries) == 0 {
		return cfg, lg, fmt.Errorf("config %s: %w: the file has no tunnels: section (see ngstone start --help)", file, errNoTunnels)
	}
	chosen, err := choose(entries, names, all, file)
	if err != nil {
		return cfg, lg, err
	}
	base := cfg.Tunnel
	for _, e := range chosen {
		t, err := e.tunnel(base)
		if err != nil {
			return cfg, lg, fmt.Errorf("config %s: tunnel %q: %w", file, e.name, err)
		}
		cfg.Tunnels = append(cfg.Tunnels, t)
	}
	if err := check(cfg); err != nil {
		return cfg, lg, fmt.Errorf("config %s: %w", file, err)
	}
	return cfg, lg, nil
}

// tunnelEntry is one entry of the tunnels: section, as the file has it.
type tunnelEntry struct {
	name     string
	settings map[string]any // lower-case keys, '_' read as '-'
}

// readTunnelEntries returns the entries of file's tunnels: section, in the
// file's order.
func readTunnelEntries(file string) ([]tunnelEntry, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", file, err)
	}
	var doc struct {
		Tunnels yaml.Node `yaml:"tunnels"`
	}
	if err := yaml.NewDecoder(bytes.NewReader(b)).Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("config %s: %w", file, err)
	}
	n := doc.Tunnels
	if n.Kind == 0 {
		return nil, nil
	}
	if n.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("config %s: tunnels: want a mapping of a name to each tunnel's settings (line %d)", file, n.Line)
	}
	var out []tunnelEntry
	for i := 0; i+1 < len(n.Content); i += 2 {
		name, val := n.Content[i].Value, n.Content[i+1]
		if val.Kind != yaml.MappingNode {
			return nil, fmt.Errorf("config %s: tunnel %q: want its settings, such as addr: 3000 (line %d)", file, name, val.Line)
		}
		raw := map[string]any{}
		if err := val.Decode(&raw); err != nil {
			return nil, fmt.Errorf("config %s: tunnel %q: %w", file, name, err)
		}
		settings := map[string]any{}
		for k, v := range raw {
			key := strings.ReplaceAll(strings.ToLower(k), "_", "-")
			if _, dup := settings[key]; dup {
				return nil, fmt.Errorf("config %s: tunnel %q: key %q given twice", file, name, key)
			}
			settings[key] = v
		}
		out = append(out, tunnelEntry{name: name, settings: settings})
	}
	return out, nil
}

// choose picks the entries names asks for (all: every one).
func choose(entries []tunnelEntry, names []string, all bool, file string) ([]tunnelEntry, error) {
	if all {
		return entries, nil
	}
	if len(names) == 0 {
		return nil, errors.New("name the tunnels to start, or give --all")
	}
	var have []string
	for _, e := range entries {
		have = append(have, e.name)
	}
	var out []tunnelEntry
	for _, name := range names {
		i := slices.Index(have, name)
		if i < 0 {
			return nil, fmt.Errorf("config %s: no tunnel %q; the file has %s", file, name, strings.Join(have, ", "))
		}
		if !slices.ContainsFunc(out, func(e tunnelEntry) bool { return e.name == name }) {
			out = append(out, entries[i])
		}
	}
	return out, nil
}

// entryKeys are the keys of a tunnel entry besides tunnelKeys.
var entryKeys = []string{"addr", "proto"}

// tunnel is the entry's tunnel: base with what the entry sets.
func (e tunnelEntry) tunnel(base agent.Tunnel) (agent.Tunnel, error) {
	t := base
	t.Name = e.name
	t.Subdomain, t.Hostname, t.RemotePort = "", "", 0
	for _, k := range slices.Sorted(maps.Keys(e.settings)) {
		if !slices.Contains(entryKeys, k) && !slices.Contains(tunnelKeys, k) {
			return t, fmt.Errorf("unknown key %q (an entry's keys are %s)", k, strings.Join(append(slices.Clone(entryKeys), tunnelKeys...), ", "))
		}
	}
	switch p := cast.ToString(e.settings["proto"]); p {
	case "", agent.ProtoHTTP:
	case agent.ProtoTCP, agent.ProtoTLS:
		t.Proto = p
	default:
		return t, fmt.Errorf("proto %q: want http (HTTP and HTTPS), tcp or tls", p)
	}
	addr, ok := e.settings["addr"]
	if !ok || strings.TrimSpace(cast.ToString(addr)) == "" {
		return t, errors.New("addr: required (the local service: PORT, HOST:PORT or URL)")
	}
	t.Local = strings.TrimSpace(cast.ToString(addr))
	v := viper.New()
	for k, val := range e.settings {
		v.Set(k, val)
	}
	err := readTunnel(&loader{v: v}, &t, func(key string) bool {
		_, ok := e.settings[key]
		return ok
	})
	return t, err
}
