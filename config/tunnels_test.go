package config_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/config"
)

func loadTunnels(t *testing.T, file string, names []string, all bool, args ...string) (agent.Config, error) {
	t.Helper()
	fs := pflag.NewFlagSet("start", pflag.ContinueOnError)
	c := config.NewAgent(fs)
	if err := fs.Parse(append([]string{"--config", file}, args...)); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.LoadTunnels(names, all)
	return cfg, err
}

const threeTunnels = `
edge: tunnels.example.com:4443
upstream-timeout: 5s
tunnels:
  web:
    addr: 3000
    subdomain: web
    basic_auth: ["alice:correct horse"]
  api:
    addr: https://localhost:8443
    subdomain: api-dev
    upstream-insecure: true
    upstream-timeout: 1m
    host-header: rewrite
  docs:
    proto: http
    addr: 127.0.0.1:4000
`

// TestLoadTunnels: the tunnels: section, in the file's order, each entry's
// settings over the top level's, ngrok's '_' spelling read.
func TestLoadTunnels(t *testing.T) {
	clearNgstoneEnv(t)
	file := writeFile(t, threeTunnels)
	cfg, err := loadTunnels(t, file, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tn := range cfg.Tunnels {
		names = append(names, tn.Name)
	}
	if !slices.Equal(names, []string{"web", "api", "docs"}) || cfg.Edge != "tunnels.example.com:4443" {
		t.Fatalf("tunnels %v, edge %q", names, cfg.Edge)
	}
	web, api, docs := cfg.Tunnels[0], cfg.Tunnels[1], cfg.Tunnels[2]
	if web.Local != "3000" || web.Subdomain != "web" || !slices.Equal(web.BasicAuth, []string{"alice:correct horse"}) || web.UpstreamTimeout != 5*time.Second {
		t.Errorf("web: %+v", web)
	}
	if !api.UpstreamInsecure || api.UpstreamTimeout != time.Minute || api.HostHeader != "rewrite" || api.Subdomain != "api-dev" {
		t.Errorf("api: %+v", api)
	}
	if docs.Subdomain != "" || docs.Local != "127.0.0.1:4000" || docs.UpstreamInsecure {
		t.Errorf("docs: %+v", docs)
	}

	// Names choose; a flag is every tunnel's, under the entry's own.
	cfg, err = loadTunnels(t, file, []string{"docs", "web"}, false, "--upstream-timeout", "7s")
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Tunnels) != 2 || cfg.Tunnels[0].Name != "docs" || cfg.Tunnels[0].UpstreamTimeout != 7*time.Second {
		t.Fatalf("start docs web: %+v", cfg.Tunnels)
	}
	if _, err := loadTunnels(t, file, []string{"nope"}, false); err == nil || !strings.Contains(err.Error(), `"nope"`) || !strings.Contains(err.Error(), "web, api, docs") {
		t.Errorf("an unknown name: %v", err)
	}
	// ngstone http still reads the same file, ignoring its tunnels:.
	fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
	c := config.NewAgent(fs)
	fs.Parse([]string{"--config", file})
	if cfg, _, err := c.Load("8080"); err != nil || cfg.Local != "8080" || len(cfg.Tunnels) != 0 {
		t.Errorf("ngstone http with the file: %v %+v", err, cfg.Tunnels)
	}
}

// TestBadTunnelEntries: an entry start-up cannot serve is an error naming
// the tunnel and the key.
func TestBadTunnelEntries(t *testing.T) {
	clearNgstoneEnv(t)
	for name, tc := range map[string]struct{ file, want string }{
		"unknown key":       {"tunnels:\n  web:\n    addr: 3000\n    subdomian: x\n", `tunnel "web": unknown key "subdomian"`},
		"missing addr":      {"tunnels:\n  web:\n    subdomain: x\n", `tunnel "web": addr: required`},
		"empty addr":        {"tunnels:\n  web:\n    addr: ''\n", `tunnel "web": addr: required`},
		"duplicate name":    {"tunnels:\n  a:\n    addr: 1\n    subdomain: x\n  b:\n    addr: 2\n    subdomain: x\n", `subdomain x is tunnel "a"'s too`},
		"bad duration":      {"tunnels:\n  web:\n    addr: 3000\n    upstream-timeout: 5\n", `tunnel "web": upstream-timeout`},
		"bad bool":          {"tunnels:\n  web:\n    addr: 3000\n    upstream-insecure: maybe\n", `tunnel "web": upstream-insecure`},
		"udp":               {"tunnels:\n  db:\n    addr: 5432\n    proto: udp\n", `tunnel "db": proto "udp": want http (HTTP and HTTPS), tcp or tls`},
		"tcp with a name":   {"tunnels:\n  db:\n    addr: 5432\n    proto: tcp\n    subdomain: db\n", `tunnel "db": subdomain, hostname: a TCP tunnel has a public port`},
		"tcp to a URL":      {"tunnels:\n  db:\n    addr: http://localhost:5432\n    proto: tcp\n", `a TCP tunnel's is PORT or HOST:PORT`},
		"tcp port twice":    {"tunnels:\n  a:\n    addr: 1\n    proto: tcp\n    remote-port: 20001\n  b:\n    addr: 2\n    proto: tcp\n    remote_port: 20001\n", `remote-port 20001 is tunnel "a"'s too`},
		"http remote-port":  {"tunnels:\n  web:\n    addr: 3000\n    remote-port: 20001\n", `remote-port: a TCP tunnel's`},
		"not a mapping":     {"tunnels:\n  - web\n", "want a mapping"},
		"entry not a map":   {"tunnels:\n  web: 3000\n", `tunnel "web": want its settings`},
		"bad local":         {"tunnels:\n  web:\n    addr: ftp://x\n", `tunnel "web": local URL "ftp://x"`},
		"top-level name":    {"subdomain: x\ntunnels:\n  web:\n    addr: 3000\n", "each tunnel asks for its own name"},
		"no tunnels":        {"edge: e:1\n", "no tunnels"},
		"key given twice":   {"tunnels:\n  web:\n    addr: 3000\n    basic_auth: [a:bbbbbbbb]\n    basic-auth: [a:cccccccc]\n", `key "basic-auth" given twice`},
		"top-level unknown": {"edg: e:1\ntunnels:\n  web:\n    addr: 3000\n", `unknown key "edg"`},
	} {
		_, err := loadTunnels(t, writeFile(t, tc.file), nil, true)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", name, err, tc.want)
		}
	}
	// Duplicate subdomains name both tunnels.
	_, err := loadTunnels(t, writeFile(t, "tunnels:\n  a:\n    addr: 1\n    subdomain: x\n  b:\n    addr: 2\n    subdomain: x\n"), nil, true)
	if err == nil || !strings.Contains(err.Error(), `"a"`) || !strings.Contains(err.Error(), `"b"`) {
		t.Errorf("duplicate subdomain: %v, want both tunnels named", err)
	}
}

// TestConfigEdit: ngstone config's edits keep the rest of the file, write
// mode 0600 in a 0700 directory, refuse what the flag would refuse, and
// leave the precedence flags > environment > file.
func TestConfigEdit(t *testing.T) {
	clearNgstoneEnv(t)
	path := filepath.Join(t.TempDir(), "fresh", "ngstone.yml")
	if err := config.SetAgentSetting(path, "authtoken", []string{"tok_1"}); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{path: 0o600, filepath.Dir(path): 0o700 | os.ModeDir} {
		if fi, err := os.Stat(p); err != nil || fi.Mode() != want {
			t.Errorf("%s: %v %v, want mode %v", p, fi.Mode(), err, want)
		}
	}
	// A file written by hand, with comments and tunnels, keeps them.
	os.WriteFile(path, []byte(threeTunnels+"# my note\nauthtoken: tok_1\n"), 0o644)
	for _, set := range [][]string{{"edge", "127.0.0.1:4443"}, {"authtoken", "tok_2"}, {"insecure", "true"}, {"basic-auth", "a:bbbbbbbb", "c:dddddddd"}, {"ca-file", "rel/ca.pem"}} {
		if err := config.SetAgentSetting(path, set[0], set[1:]); err != nil {
			t.Fatalf("set %v: %v", set, err)
		}
	}
	before, _ := os.ReadFile(path)
	for _, bad := range [][]string{{"insecure", "maybe"}, {"dial-timeout", "5"}, {"edge", "a", "b"}, {"subdomian", "x"}, {"config", "x"}, {"edge"}} {
		if err := config.SetAgentSetting(path, bad[0], bad[1:]); err == nil {
			t.Errorf("set %v: accepted", bad)
		}
	}
	if after, _ := os.ReadFile(path); string(after) != string(before) {
		t.Errorf("a refused set changed the file:\n%s", after)
	}
	if fi, _ := os.Stat(path); fi.Mode() != 0o600 {
		t.Errorf("after an edit the file is %v, want 0600", fi.Mode())
	}
	text := string(before)
	for _, want := range []string{"# my note", "subdomain: api-dev", "edge: 127.0.0.1:4443", "authtoken: tok_2", "insecure: true", "- c:dddddddd"} {
		if !strings.Contains(text, want) {
			t.Errorf("the file lacks %q:\n%s", want, text)
		}
	}
	if strings.Count(text, "authtoken:") != 1 || strings.Contains(text, "tunnels.example.com") {
		t.Errorf("a set key appears twice or kept its old value:\n%s", text)
	}
	if abs, _ := filepath.Abs("rel/ca.pem"); !strings.Contains(text, "ca-file: "+abs) {
		t.Errorf("a relative file is saved as it was given, not from where it was given:\n%s", text)
	}
	if err := config.UnsetAgentSetting(path, "ca-file"); err != nil {
		t.Fatal(err)
	}
	if err := config.UnsetAgentSetting(path, "ca-file"); err == nil {
		t.Error("unset of a key the file lacks: no error")
	}
	if names, err := config.CheckAgentFile(path); err != nil || !slices.Equal(names, []string{"web", "api", "docs"}) {
		t.Fatalf("check: %v %v", names, err)
	}
	if entries, _ := os.ReadDir(filepath.Dir(path)); len(entries) != 1 {
		t.Errorf("the directory holds %d files, want the settings file alone (no temporary left)", len(entries))
	}

	// Flags > environment > file > defaults.
	t.Setenv("XDG_CONFIG_HOME", filepath.Dir(filepath.Dir(path)))
	if err := os.Rename(filepath.Dir(path), filepath.Join(filepath.Dir(filepath.Dir(path)), "ngstone")); err != nil {
		t.Fatal(err)
	}
	load := func(args ...string) agent.Config {
		fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
		c := config.NewAgent(fs)
		fs.Parse(args)
		cfg, _, err := c.Load("3000")
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	if cfg := load(); cfg.Edge != "127.0.0.1:4443" || cfg.Token != "tok_2" || cfg.UpstreamTimeout != 5*time.Second {
		t.Errorf("the default file: edge %q token %q upstream-timeout %s", cfg.Edge, cfg.Token, cfg.UpstreamTimeout)
	}
	t.Setenv("NGSTONE_EDGE", "env:1")
	if cfg := load(); cfg.Edge != "env:1" {
		t.Errorf("environment under the file: %q", cfg.Edge)
	}
	if cfg := load("--edge", "flag:1"); cfg.Edge != "flag:1" {
		t.Errorf("flag under the environment: %q", cfg.Edge)
	}
}

// TestCheckAgentFile: check fails where start or http would.
func TestCheckAgentFile(t *testing.T) {
	clearNgstoneEnv(t)
	if _, err := config.CheckAgentFile(filepath.Join(t.TempDir(), "none.yml")); err == nil || !strings.Contains(err.Error(), "add-authtoken") {
		t.Errorf("no file: %v", err)
	}
	if _, err := config.CheckAgentFile(writeFile(t, "edge: e:1\ndial-timeout: soon\n")); err == nil || !strings.Contains(err.Error(), "dial-timeout") {
		t.Errorf("a bad value: %v", err)
	}
	if _, err := config.CheckAgentFile(writeFile(t, "tunnels:\n  web:\n    adr: 3000\n")); err == nil || !strings.Contains(err.Error(), `tunnel "web"`) {
		t.Errorf("a bad entry: %v", err)
	}
	if names, err := config.CheckAgentFile(writeFile(t, "edge: e:1\n")); err != nil || names != nil {
		t.Errorf("a file without tunnels: %v %v", names, err)
	}
}
