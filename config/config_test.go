package config_test

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"go.uber.org/goleak"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/config"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ngstone.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func loadEdge(t *testing.T, args ...string) (*config.Edge, error) {
	t.Helper()
	fs := pflag.NewFlagSet("edge", pflag.ContinueOnError)
	c := config.NewEdge(fs)
	return c, fs.Parse(args)
}

// TestEdgePrecedence: flags beat environment, environment beats the file,
// the file beats defaults — for every kind of value.
func TestEdgePrecedence(t *testing.T) {
	file := writeFile(t, `
domain: file.example
drain-timeout: 3s
heartbeat-timeout: 20s
token: [file-a, file-b]
reserved-names: [www]
http-addr: 127.0.0.1:8001
`)
	t.Setenv("NGSTONE_HEARTBEAT_TIMEOUT", "30s")
	t.Setenv("NGSTONE_HTTP_ADDR", "127.0.0.1:8002")
	t.Setenv("NGSTONE_TOKEN", "env-a,env-b")
	c, err := loadEdge(t, "--config", file, "--http-addr", "127.0.0.1:8003")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load()
	if err != nil {
		t.Fatal(err)
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"domain from file", cfg.Domain, "file.example"},
		{"drain-timeout from file", cfg.DrainTimeout, 3 * time.Second},
		{"heartbeat-timeout env over file", cfg.HeartbeatTimeout, 30 * time.Second},
		{"http-addr flag over env", cfg.HTTPAddr, "127.0.0.1:8003"},
		{"token env over file", strings.Join(cfg.Tokens, ","), "env-a,env-b"},
		{"reserved-names from file", strings.Join(cfg.ReservedNames, ","), "www"},
		{"tunnel-timeout default", cfg.TunnelTimeout, 60 * time.Second},
		{"control-addr default", cfg.ControlAddr, ":4443"},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s: got %v, want %v", c.name, c.got, c.want)
		}
	}
}

// TestEnvironmentOnly: environment variables reach the struct for keys that
// are neither flags given nor in a file.
func TestEnvironmentOnly(t *testing.T) {
	t.Setenv("NGSTONE_DOMAIN", "env.example")
	t.Setenv("NGSTONE_DRAIN_TIMEOUT", "0")
	t.Setenv("NGSTONE_ADMIN_ADDR", "127.0.0.1:9999")
	t.Setenv("NGSTONE_TLS_MODE", "files")
	t.Setenv("NGSTONE_TLS_CERT", "/c.pem")
	t.Setenv("NGSTONE_TLS_KEY", "/k.pem")
	c, _ := loadEdge(t)
	cfg, _, err := c.Load()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Domain != "env.example" || cfg.DrainTimeout != 0 || cfg.AdminAddr != "127.0.0.1:9999" ||
		cfg.TLS.Mode != "files" || !slices.Equal(cfg.TLS.CertFiles, []string{"/c.pem"}) || !slices.Equal(cfg.TLS.KeyFiles, []string{"/k.pem"}) {
		t.Fatalf("environment did not reach the config: %+v", cfg)
	}
}

// TestEmptyEnvironmentDisables: a listener's variable set to nothing
// disables it, as the empty flag does.
func TestEmptyEnvironmentDisables(t *testing.T) {
	t.Setenv("NGSTONE_DOMAIN", "env.example")
	t.Setenv("NGSTONE_HTTPS_ADDR", "")
	t.Setenv("NGSTONE_ADMIN_ADDR", "")
	c, _ := loadEdge(t)
	cfg, _, err := c.Load()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.HTTPSAddr != "" || cfg.AdminAddr != "" || cfg.HTTPAddr == "" {
		t.Fatalf("https %q, admin %q, http %q: want the first two disabled", cfg.HTTPSAddr, cfg.AdminAddr, cfg.HTTPAddr)
	}
}

func TestEdgeErrorsNameKeyAndValue(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		file string
		args []string
		want []string
	}{
		{"missing domain", nil, "", nil, []string{"domain", "required"}},
		{"bad duration env", map[string]string{"NGSTONE_DRAIN_TIMEOUT": "ten"}, "", []string{"--domain", "x.example"}, []string{"drain-timeout", `"ten"`}},
		{"duration without unit", nil, "domain: x.example\ndrain-timeout: 10\n", nil, []string{"drain-timeout", "10"}},
		{"unknown file key", nil, "domain: x.example\ndrain_timout: 1s\n", nil, []string{"unknown key", "drain_timout"}},
		{"bad tls mode", nil, "", []string{"--domain", "x.example", "--tls-mode", "acme"}, []string{"tls-mode", `"acme"`}},
		{"bad address", nil, "", []string{"--domain", "x.example", "--http-addr", "80"}, []string{"http-addr", `"80"`}},
		{"bad log format", nil, "", []string{"--domain", "x.example", "--log-format", "xml"}, []string{"log-format", `"xml"`}},
		{"bad reserved name", nil, "", []string{"--domain", "x.example", "--reserved-names", "Bad_Name"}, []string{"reserved-names", "Bad_Name"}},
		{"empty duration env", map[string]string{"NGSTONE_DRAIN_TIMEOUT": ""}, "", []string{"--domain", "x.example"}, []string{"drain-timeout", `""`}},
		{"empty number env", map[string]string{"NGSTONE_MAX_CONNS": ""}, "", []string{"--domain", "x.example"}, []string{"max-conns", `""`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			args := tc.args
			if tc.file != "" {
				args = append(args, "--config", writeFile(t, tc.file))
			}
			c, err := loadEdge(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			_, _, err = c.Load()
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %s", err, w)
				}
			}
		})
	}
}

func TestAgentLoad(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "token")
	os.WriteFile(secret, []byte("s3cret\n"), 0o600)
	t.Setenv("NGSTONE_AUTHTOKEN_FILE", secret)
	t.Setenv("NGSTONE_HEARTBEAT_INTERVAL", "2s")
	file := writeFile(t, "edge: edge.example:4443\nsubdomain: myapp\nupstream-timeout: 5s\n")
	fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
	c := config.NewAgent(fs)
	if err := fs.Parse([]string{"--config", file, "--insecure"}); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load("3000")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Edge != "edge.example:4443" || cfg.Subdomain != "myapp" || cfg.Token != "s3cret" || !cfg.Insecure ||
		cfg.UpstreamTimeout != 5*time.Second || cfg.HeartbeatInterval != 2*time.Second || cfg.HeartbeatTimeout != 45*time.Second || cfg.Local != "3000" ||
		cfg.UpstreamCAFile != "" || cfg.UpstreamInsecure {
		t.Fatalf("agent config: %+v", cfg)
	}
}

// TestAgentUpstreamTLS: the https:// local service's trust settings come
// from flags, the environment and the file like every other.
func TestAgentUpstreamTLS(t *testing.T) {
	t.Setenv("NGSTONE_UPSTREAM_INSECURE", "true")
	file := writeFile(t, "edge: edge.example:4443\nupstream-ca-file: /etc/dev-ca.pem\n")
	fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
	c := config.NewAgent(fs)
	if err := fs.Parse([]string{"--config", file}); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load("https://localhost:8443")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.UpstreamCAFile != "/etc/dev-ca.pem" || !cfg.UpstreamInsecure {
		t.Fatalf("upstream TLS: ca file %q, insecure %v", cfg.UpstreamCAFile, cfg.UpstreamInsecure)
	}
}

func TestAgentErrors(t *testing.T) {
	cases := []struct {
		name, local string
		args        []string
		want        string
	}{
		{"bad local", "not a port", nil, "local address"},
		{"bad port", "70000", nil, "local port 70000"},
		{"bad subdomain", "3000", []string{"--subdomain", "-x"}, "subdomain"},
		{"heartbeat order", "3000", []string{"--heartbeat-interval", "10s", "--heartbeat-timeout", "5s"}, "heartbeat-timeout"},
		{"zero heartbeat", "3000", []string{"--heartbeat-interval", "0s"}, "heartbeat-interval 0"},
		{"upstream CA for plain http", "3000", []string{"--upstream-ca-file", "ca.pem"}, "upstream-ca-file: the local service http://localhost:3000 is not https://"},
		{"upstream insecure for plain http", "http://localhost:3000", []string{"--upstream-insecure"}, "upstream-insecure: the local service http://localhost:3000 is not https://"},
		{"host header with a space", "3000", []string{"--host-header", "a b"}, `host-header "a b": want rewrite, or a HOST[:PORT]`},
		{"host header with a slash", "3000", []string{"--host-header", "a/b"}, `host-header "a/b"`},
		{"inspector on a public address", "3000", []string{"--inspect-addr", "0.0.0.0:4040"}, `inspect-addr "0.0.0.0:4040": want a loopback HOST:PORT`},
		{"inspector without a port", "3000", []string{"--inspect-addr", "127.0.0.1"}, `inspect-addr "127.0.0.1"`},
		{"basic auth without a colon", "3000", []string{"--basic-auth", "alice"}, "basic-auth: want USER:PASSWORD"},
		{"basic auth without a user", "3000", []string{"--basic-auth", ":password1"}, "basic-auth: want USER:PASSWORD"},
		{"basic auth, short password", "3000", []string{"--basic-auth", "alice:short"}, `basic-auth: the password of "alice" is shorter than 8 characters`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
			c := config.NewAgent(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			_, _, err := c.Load(tc.local)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want mention of %q", err, tc.want)
			}
		})
	}
}

// TestAgentLogRequests: off by default; a default of true (what the CLI
// sets when stderr is a terminal) holds unless a flag, the environment or
// the file says false.
func TestAgentLogRequests(t *testing.T) {
	load := func(termDefault bool, env string, args ...string) bool {
		t.Helper()
		return loadAgent(t, "NGSTONE_LOG_REQUESTS", env, func(fs *pflag.FlagSet) {
			if termDefault {
				fs.Lookup("log-requests").DefValue = "true"
			}
		}, args...).LogRequests
	}
	off := writeFile(t, "log-requests: false\n")
	for _, tc := range []struct {
		name        string
		termDefault bool
		env         string
		args        []string
		want        bool
	}{
		{"default", false, "", nil, false},
		{"flag", false, "", []string{"--log-requests"}, true},
		{"environment", false, "true", nil, true},
		{"terminal", true, "", nil, true},
		{"terminal, flag false", true, "", []string{"--log-requests=false"}, false},
		{"terminal, environment false", true, "false", nil, false},
		{"terminal, file false", true, "", []string{"--config", off}, false},
	} {
		if got := load(tc.termDefault, tc.env, tc.args...); got != tc.want {
			t.Errorf("%s: LogRequests %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestAgentBasicAuth: pairs keep their commas and spaces when given as
// repeated flags or a YAML list; the environment gives one per line.
func TestAgentBasicAuth(t *testing.T) {
	load := func(env string, args ...string) []string {
		t.Helper()
		return loadAgent(t, "NGSTONE_BASIC_AUTH", env, nil, args...).BasicAuth
	}
	file := writeFile(t, "basic-auth:\n  - \"alice:pass,word1\"\n  - bob:password2\n")
	for _, tc := range []struct {
		name string
		env  string
		args []string
		want []string
	}{
		{"none", "", nil, nil},
		{"flags", "", []string{"--basic-auth", "alice:pass,word1", "--basic-auth", "bob:password2"}, []string{"alice:pass,word1", "bob:password2"}},
		{"file", "", []string{"--config", file}, []string{"alice:pass,word1", "bob:password2"}},
		{"environment", "alice:pass,word1\nbob:correct horse\n", nil, []string{"alice:pass,word1", "bob:correct horse"}},
		{"environment, one", "bob:correct horse", nil, []string{"bob:correct horse"}},
	} {
		if got := load(tc.env, tc.args...); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestAgentHeaderRules: a rule keeps its spaces and commas from flags, a
// YAML list and the environment (one per line).
func TestAgentHeaderRules(t *testing.T) {
	want := []string{"X-Team: blue, green", "Cache-Control: no-store"}
	file := writeFile(t, "request-header-add:\n  - \"X-Team: blue, green\"\n  - \"Cache-Control: no-store\"\n")
	for name, got := range map[string][]string{
		"flags":       loadAgent(t, "", "", nil, "--request-header-add", want[0], "--request-header-add", want[1], "3000").RequestHeaderAdd,
		"file":        loadAgent(t, "", "", nil, "--config", file, "3000").RequestHeaderAdd,
		"environment": loadAgent(t, "NGSTONE_REQUEST_HEADER_ADD", strings.Join(want, "\n"), nil, "3000").RequestHeaderAdd,
	} {
		if !slices.Equal(got, want) {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}
}

// loadAgent loads the agent's settings from args, with the environment
// variable key set to env (when not empty) and nothing else of ngstone's;
// tune, when set, adjusts the flags before they are parsed.
func loadAgent(t *testing.T, key, env string, tune func(*pflag.FlagSet), args ...string) agent.Config {
	t.Helper()
	clearNgstoneEnv(t)
	if env != "" {
		t.Setenv(key, env)
	}
	fs := pflag.NewFlagSet("http", pflag.ContinueOnError)
	c := config.NewAgent(fs)
	if tune != nil {
		tune(fs)
	}
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load("3000")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestEdgeACMERetry: the retry schedule of certificate attempts comes from
// --acme-retry-base and --acme-retry-max (zero: the certs defaults).
func TestEdgeACMERetry(t *testing.T) {
	t.Setenv("NGSTONE_ACME_RETRY_MAX", "3h")
	c, err := loadEdge(t, "--domain", "d.example", "--acme-retry-base", "5m")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.TLS.RetryBase != 5*time.Minute || cfg.TLS.RetryMax != 3*time.Hour {
		t.Errorf("RetryBase %v RetryMax %v, want 5m 3h", cfg.TLS.RetryBase, cfg.TLS.RetryMax)
	}
}

// TestEdgeProxyProtocolFromMapped: a load balancer's prefix in IPv4-mapped
// form is the IPv4 prefix it means (the edge compares the peer's address
// unmapped), and one too short to be IPv4 is refused.
func TestEdgeProxyProtocolFromMapped(t *testing.T) {
	c, err := loadEdge(t, "--domain", "d.example", "--proxy-protocol-from", "::ffff:10.0.0.0/104", "--proxy-protocol-from", "2001:db8::/32")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _, err := c.Load()
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("2001:db8::/32")}
	if !slices.Equal(cfg.ProxyProtocolFrom, want) {
		t.Errorf("proxy-protocol-from: %v, want %v", cfg.ProxyProtocolFrom, want)
	}
	c, err = loadEdge(t, "--domain", "d.example", "--proxy-protocol-from", "::ffff:0.0.0.0/95")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Load(); err == nil || !strings.Contains(err.Error(), "proxy-protocol-from") {
		t.Errorf("a mapped prefix of 95 bits: %v, want refused naming proxy-protocol-from", err)
	}
}
