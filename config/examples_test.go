package config_test

import (
	"bufio"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"

	"github.com/ngstone/ngstone/certs"
	"github.com/ngstone/ngstone/config"
	"github.com/ngstone/ngstone/edge"
)

const examplesDir = "../examples"

// edgeLoader returns the edge's flag set and loader, args parsed.
func exampleEdgeFlags(t *testing.T, args ...string) (*pflag.FlagSet, *config.Edge) {
	t.Helper()
	fs := pflag.NewFlagSet("edge", pflag.ContinueOnError)
	l := config.NewEdge(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	return fs, l
}

// loadEdge loads and validates an edge configuration, and builds the edge
// from it (New checks what Validate cannot, e.g. the TLS mode's settings;
// it does no I/O).
func loadExampleEdge(t *testing.T, args ...string) edge.Config {
	t.Helper()
	// The examples keep the DNS token in the environment (edge.env, the
	// compose file's variables); New requires it.
	if os.Getenv("CLOUDFLARE_API_TOKEN") == "" {
		t.Setenv("CLOUDFLARE_API_TOKEN", "example-token")
	}
	_, l := exampleEdgeFlags(t, args...)
	cfg, _, err := l.Load()
	if err != nil {
		t.Fatalf("load edge %v: %v", args, err)
	}
	e, err := edge.New(cfg, nil)
	if err != nil {
		t.Fatalf("edge.New from %v: %v", args, err)
	}
	t.Cleanup(func() { e.Close() })
	return cfg
}

// clearEnv keeps the runner's NGSTONE_* variables out of a test.
func clearNgstoneEnv(t *testing.T) {
	// No settings file of the user's either: the default one is under
	// the user config directory.
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, config.EnvPrefix+"_") {
			t.Setenv(k, "")
			os.Unsetenv(k)
		}
	}
}

func TestExampleEdgeYAML(t *testing.T) {
	clearNgstoneEnv(t)
	cfg := loadExampleEdge(t, "--config", filepath.Join(examplesDir, "edge.yaml"))
	if cfg.Domain != "tunnels.example.com" || cfg.TLS.Mode != certs.ModeCertmagic || cfg.TLS.DNSProvider != "cloudflare" {
		t.Errorf("edge.yaml loaded as domain %q mode %q dns %q", cfg.Domain, cfg.TLS.Mode, cfg.TLS.DNSProvider)
	}
	if cfg.AdminToken != "" {
		t.Error("edge.yaml should keep its admin API on loopback, without a token")
	}
}

func TestExampleAgentYAML(t *testing.T) {
	clearNgstoneEnv(t)
	fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
	l := config.NewAgent(fs)
	if err := fs.Parse([]string{"--config", filepath.Join(examplesDir, "agent.yaml")}); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := l.Load("3000")
	if err != nil {
		t.Fatalf("load agent.yaml: %v", err)
	}
	if cfg.Edge != "tunnels.example.com:4443" || cfg.Subdomain != "myapp" || !cfg.LogRequests {
		t.Errorf("agent.yaml loaded as edge %q subdomain %q log-requests %v", cfg.Edge, cfg.Subdomain, cfg.LogRequests)
	}
}

func TestExampleTunnelsYAML(t *testing.T) {
	clearNgstoneEnv(t)
	fs := pflag.NewFlagSet("start", pflag.ContinueOnError)
	l := config.NewAgent(fs)
	if err := fs.Parse([]string{"--config", filepath.Join(examplesDir, "tunnels.yaml")}); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := l.LoadTunnels(nil, true)
	if err != nil {
		t.Fatalf("load tunnels.yaml: %v", err)
	}
	if len(cfg.Tunnels) != 3 || cfg.Tunnels[1].Name != "api" || !cfg.Tunnels[1].UpstreamInsecure || cfg.Tunnels[2].UpstreamProtocol != "http2" {
		t.Fatalf("tunnels.yaml loaded as %+v", cfg.Tunnels)
	}
	// An entry's visitor policy and header rules are its own.
	web, api := cfg.Tunnels[0], cfg.Tunnels[1]
	if !slices.Equal(api.AllowCIDR, []string{"192.0.2.0/24"}) || !slices.Equal(api.RequestHeaderAdd, []string{"X-Env: dev"}) ||
		len(web.AllowCIDR) != 0 || len(web.RequestHeaderAdd) != 0 {
		t.Errorf("per-tunnel allow-cidr and request-header-add: web %q %q, api %q %q", web.AllowCIDR, web.RequestHeaderAdd, api.AllowCIDR, api.RequestHeaderAdd)
	}
}

// TestExampleYAMLRefusesTypos proves the loader behind the two tests above
// would catch a key that is not a flag.
func TestExampleYAMLRefusesTypos(t *testing.T) {
	clearNgstoneEnv(t)
	b, err := os.ReadFile(filepath.Join(examplesDir, "edge.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(t.TempDir(), "edge.yaml")
	os.WriteFile(bad, append(b, "drain-timout: 5s\n"...), 0o600)
	_, l := exampleEdgeFlags(t, "--config", bad)
	if _, _, err := l.Load(); err == nil || !strings.Contains(err.Error(), "drain-timout") {
		t.Fatalf("a misspelt key loaded: %v", err)
	}
}

type composeFile struct {
	Services map[string]struct {
		Command     []string          `yaml:"command"`
		Environment map[string]string `yaml:"environment"`
		Ports       []string          `yaml:"ports"`
		Expose      []string          `yaml:"expose"`
		Volumes     []string          `yaml:"volumes"`
	} `yaml:"services"`
}

// composeVar matches ${NAME}, ${NAME:-default} and ${NAME:?message}.
var composeVar = regexp.MustCompile(`\$\{([A-Z_][A-Z0-9_]*)(?::?[-?][^}]*)?\}`)

// TestExampleCompose checks that every flag and NGSTONE_* variable of the
// compose file is one the edge knows, that the other variables are the DNS
// provider's, and that the service's settings, applied as the container
// would see them, load and validate.
func TestExampleCompose(t *testing.T) {
	clearNgstoneEnv(t)
	b, err := os.ReadFile(filepath.Join(examplesDir, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var c composeFile
	if err := yaml.Unmarshal(b, &c); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	svc, ok := c.Services["edge"]
	if !ok {
		t.Fatal("docker-compose.yml: no service named edge")
	}
	fs, _ := exampleEdgeFlags(t)
	for _, arg := range svc.Command {
		if name, ok := strings.CutPrefix(arg, "--"); ok && fs.Lookup(strings.SplitN(name, "=", 2)[0]) == nil {
			t.Errorf("command flag %s is not an edge flag", arg)
		}
	}
	provider := svc.Environment["NGSTONE_DNS_PROVIDER"]
	for k, v := range svc.Environment {
		if !exampleEnvKnown(fs, provider, k) {
			t.Errorf("environment %s is neither an edge flag's NGSTONE_* variable nor a setting of dns-provider %q", k, provider)
		}
		// What the container sees: compose substitutes ${VAR...}.
		t.Setenv(k, composeVar.ReplaceAllString(v, "x"+strings.ToLower(k)))
	}
	t.Setenv("NGSTONE_DOMAIN", "tunnels.example.com")
	t.Setenv("NGSTONE_DATA_DIR", "/data") // set by the Dockerfile
	cfg := loadExampleEdge(t, svc.Command...)
	if cfg.AdminToken == "" || cfg.TLS.DNSProvider != "cloudflare" || len(cfg.Tokens) != 1 {
		t.Errorf("compose loaded as admin token %q, dns %q, tokens %v", cfg.AdminToken, cfg.TLS.DNSProvider, cfg.Tokens)
	}
	for _, p := range []string{"80:80", "443:443", "4443:4443"} {
		if !slices.Contains(svc.Ports, p) {
			t.Errorf("ports %v: missing %s", svc.Ports, p)
		}
	}
	if !slices.ContainsFunc(svc.Volumes, func(v string) bool { return strings.HasSuffix(v, ":/data") }) {
		t.Errorf("volumes %v: nothing mounted at /data", svc.Volumes)
	}
}

// envKnown reports whether k is NGSTONE_ + an edge flag (or a secret flag's
// _FILE), or an environment variable of the DNS provider.
func exampleEnvKnown(fs *pflag.FlagSet, provider, k string) bool {
	if name, ok := strings.CutPrefix(k, config.EnvPrefix+"_"); ok {
		name = strings.TrimSuffix(name, "_FILE")
		return fs.Lookup(strings.ReplaceAll(strings.ToLower(name), "_", "-")) != nil
	}
	for _, s := range certs.DNSProviders()[provider] {
		if strings.Contains(s, "$"+k+",") || strings.Contains(s, "$"+k+")") {
			return true
		}
	}
	return false
}

// TestExampleSystemdUnit checks the unit runs `ngstone edge` with flags the
// edge knows, reads the example edge.yaml, and keeps state where that file
// says.
func TestExampleSystemdUnit(t *testing.T) {
	clearNgstoneEnv(t)
	f, err := os.Open(filepath.Join(examplesDir, "ngstone-edge.service"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	keys := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			keys[k] = v
		}
	}
	args := strings.Fields(keys["ExecStart"])
	if len(args) < 2 || filepath.Base(args[0]) != "ngstone" || args[1] != "edge" {
		t.Fatalf("ExecStart %q: want ngstone edge ...", keys["ExecStart"])
	}
	fs, _ := exampleEdgeFlags(t)
	var cfgFile string
	for i, a := range args[2:] {
		if name, ok := strings.CutPrefix(a, "--"); ok {
			if fs.Lookup(name) == nil {
				t.Errorf("ExecStart flag %s is not an edge flag", a)
			}
			if name == "config" && i+3 < len(args) {
				cfgFile = args[i+3]
			}
		}
	}
	if filepath.Base(cfgFile) != "edge.yaml" {
		t.Fatalf("ExecStart reads %q, want the example edge.yaml", cfgFile)
	}
	cfg := loadExampleEdge(t, "--config", filepath.Join(examplesDir, "edge.yaml"))
	if want := "/var/lib/" + keys["StateDirectory"]; cfg.TLS.DataDir != want {
		t.Errorf("edge.yaml data-dir %q, but the unit's StateDirectory is %s", cfg.TLS.DataDir, want)
	}
	if keys["KillSignal"] != "SIGTERM" || keys["TimeoutStopSec"] == "" {
		t.Errorf("KillSignal %q TimeoutStopSec %q: want a graceful SIGTERM with a stop timeout", keys["KillSignal"], keys["TimeoutStopSec"])
	}
}
