package certs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"sort"
	"strings"

	"github.com/caddyserver/certmagic"
)

// DNS provider names of Config.DNSProvider.
const (
	DNSCloudflare = "cloudflare"
	DNSRFC2136    = "rfc2136"
)

// dnsSetting is one setting of a DNS provider: its key in
// Config.DNSCredentials and its environment variable.
type dnsSetting struct {
	key, env string
	required bool
}

// dnsProviderSpec describes one provider and builds it from its settings.
type dnsProviderSpec struct {
	settings []dnsSetting
	build    func(vals map[string]string) (certmagic.DNSProvider, error)
}

var dnsProviders = map[string]dnsProviderSpec{
	DNSCloudflare: {
		// As libdns/cloudflare and Caddy name them: api_token edits the
		// records (Zone.DNS:Edit), zone_token, if given, finds the zone
		// (Zone.Zone:Read, may span all zones).
		settings: []dnsSetting{
			{key: "api_token", env: "CLOUDFLARE_API_TOKEN", required: true},
			{key: "zone_token", env: "CLOUDFLARE_ZONE_TOKEN"},
			{key: "base_url", env: "CLOUDFLARE_BASE_URL"},
		},
		build: newCloudflare,
	},
	DNSRFC2136: {
		settings: []dnsSetting{
			{key: "server", env: "RFC2136_NAMESERVER", required: true},
			{key: "tsig_key", env: "RFC2136_TSIG_KEY"},
			{key: "tsig_secret", env: "RFC2136_TSIG_SECRET"},
			{key: "tsig_algorithm", env: "RFC2136_TSIG_ALGORITHM"},
		},
		build: newRFC2136,
	},
}

// DNSProviders lists the names Config.DNSProvider accepts, with their
// settings, for help text.
func DNSProviders() map[string][]string {
	out := map[string][]string{}
	for name, spec := range dnsProviders {
		for _, s := range spec.settings {
			out[name] = append(out[name], s.key+" ($"+s.env+", $"+s.env+"_FILE)")
		}
	}
	return out
}

func dnsProviderNames() []string {
	names := make([]string, 0, len(dnsProviders))
	for n := range dnsProviders {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// dnsChecker is a provider that can check, without changing anything,
// that its server answers and accepts its credentials for the zone of
// fqdn: run before each order, so that an outage or a refused key costs
// the CA nothing.
type dnsChecker interface {
	check(ctx context.Context, fqdn string) error
}

// checkDNSProvider checks cfg's provider settings without I/O: those
// given inline or in the environment (settings read from files are
// checked by Start).
func checkDNSProvider(cfg Config) error {
	spec, ok := dnsProviders[cfg.DNSProvider]
	if !ok {
		return fmt.Errorf("dns-provider %q: %w (one of %v)", cfg.DNSProvider, ErrUnknownDNSProvider, dnsProviderNames())
	}
	vals := map[string]string{}
	for _, s := range spec.settings {
		if cfg.DNSCredentials[s.key+"_file"] != "" || cfg.getenv(s.env+"_FILE") != "" {
			return nil
		}
		v := cfg.DNSCredentials[s.key]
		if v == "" {
			v = cfg.getenv(s.env)
		}
		if v == "" && s.required {
			return fmt.Errorf("dns-provider %s: setting %s is required (or $%s, $%s_FILE)", cfg.DNSProvider, s.key, s.env, s.env)
		}
		vals[s.key] = v
	}
	if _, err := spec.build(vals); err != nil {
		return fmt.Errorf("dns-provider %s: %w", cfg.DNSProvider, err)
	}
	return nil
}

// settingsDigest identifies the settings an attempt to obtain a
// certificate depends on (the secrets included, as a truncated hash), so
// the retry book can tell that an operator changed them.
func settingsDigest(cfg Config) string {
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%s\n%s\n%s\n%v\n", cfg.Mode, cfg.Domain, cfg.ACMECA, cfg.DNSProvider, cfg.DNSResolvers)
	if spec, ok := dnsProviders[cfg.DNSProvider]; ok {
		for _, s := range spec.settings {
			v, _ := lookupSetting(cfg, s)
			fmt.Fprintf(h, "%s=%s\n", s.key, v)
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// newDNSProvider builds cfg.DNSProvider from its settings. It reads
// secret files, so it runs in Start, not in New.
func newDNSProvider(cfg Config) (certmagic.DNSProvider, error) {
	spec, ok := dnsProviders[cfg.DNSProvider]
	if !ok {
		return nil, fmt.Errorf("dns-provider %q: %w (one of %v)", cfg.DNSProvider, ErrUnknownDNSProvider, dnsProviderNames())
	}
	vals := map[string]string{}
	for _, s := range spec.settings {
		v, err := lookupSetting(cfg, s)
		if err != nil {
			return nil, fmt.Errorf("dns-provider %s: %w", cfg.DNSProvider, err)
		}
		if v == "" && s.required {
			return nil, fmt.Errorf("dns-provider %s: setting %s is required (or $%s, $%s_FILE)", cfg.DNSProvider, s.key, s.env, s.env)
		}
		vals[s.key] = v
	}
	p, err := spec.build(vals)
	if err != nil {
		return nil, fmt.Errorf("dns-provider %s: %w", cfg.DNSProvider, err)
	}
	return p, nil
}

// lookupSetting reads one setting: the config value, the config's file,
// the environment variable, the environment's file, first found wins.
func lookupSetting(cfg Config, s dnsSetting) (string, error) {
	if v := cfg.DNSCredentials[s.key]; v != "" {
		return v, nil
	}
	if f := cfg.DNSCredentials[s.key+"_file"]; f != "" {
		return readSecretFile(s.key+"_file", f)
	}
	if v := cfg.getenv(s.env); v != "" {
		return v, nil
	}
	if f := cfg.getenv(s.env + "_FILE"); f != "" {
		return readSecretFile("$"+s.env+"_FILE", f)
	}
	return "", nil
}

func readSecretFile(setting, path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("setting %s: %w", setting, err)
	}
	return strings.TrimSpace(string(b)), nil
}
