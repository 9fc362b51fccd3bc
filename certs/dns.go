package certs

import (
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
