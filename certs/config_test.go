package certs

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func fakeEnv(env map[string]string) func(string) string {
	return func(k string) string { return env[k] }
}

func writeTemp(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestNewValidation: New refuses bad settings with an error naming the
// mode and the setting, without any I/O.
func TestNewValidation(t *testing.T) {
	tests := map[string]struct {
		cfg     Config
		is      error
		mention []string
	}{
		"unknown mode":      {cfg: Config{Mode: "magic", Domain: "d.test"}, is: ErrUnknownMode, mention: []string{"magic", "certmagic"}},
		"no domain":         {cfg: Config{Mode: ModeSelfSigned}, mention: []string{"domain"}},
		"files without key": {cfg: Config{Mode: ModeFiles, Domain: "d.test", CertFiles: []string{"c.pem"}}, mention: []string{"tls-mode files", "tls-key"}},
		"certmagic without dns or on-demand": {
			cfg: Config{Mode: ModeCertmagic, Domain: "d.test"}, mention: []string{"tls-mode certmagic", "dns-provider", "on-demand", "cloudflare"},
		},
		"unknown dns provider": {
			cfg: Config{Mode: ModeCertmagic, Domain: "d.test", DNSProvider: "route99"}, is: ErrUnknownDNSProvider,
			mention: []string{"route99", "cloudflare", "rfc2136"},
		},
		"tsig secret not base64": {
			cfg:     Config{Mode: ModeCertmagic, Domain: "d.test", DNSProvider: DNSRFC2136, DNSCredentials: map[string]string{"server": "127.0.0.1:53", "tsig_key": "k", "tsig_secret": "not base64!"}},
			mention: []string{"tls-mode certmagic", "dns-provider rfc2136", "tsig_secret", "not base64", "k"},
		},
		"tsig algorithm unknown": {
			cfg:     Config{Mode: ModeCertmagic, Domain: "d.test", DNSProvider: DNSRFC2136, DNSCredentials: map[string]string{"server": "127.0.0.1", "tsig_key": "k", "tsig_secret": "c2VjcmV0", "tsig_algorithm": "hmac-md5"}},
			mention: []string{"tsig_algorithm", "hmac-md5", "hmac-sha256"},
		},
		"tsig secret without key": {
			cfg:     Config{Mode: ModeCertmagic, Domain: "d.test", DNSProvider: DNSRFC2136, DNSCredentials: map[string]string{"server": "127.0.0.1", "tsig_secret": "c2VjcmV0"}},
			mention: []string{"tsig_key is required with tsig_secret"},
		},
		"rfc2136 bad port": {
			cfg:     Config{Mode: ModeCertmagic, Domain: "d.test", DNSProvider: DNSRFC2136, DNSCredentials: map[string]string{"server": "127.0.0.1:dns"}},
			mention: []string{"setting server", "127.0.0.1:dns"},
		},
		"plain http acme ca": {
			cfg: Config{Mode: ModeAutocert, Domain: "d.test", ACMECA: "http://ca.test/dir"}, mention: []string{"tls-mode autocert", "acme-ca"},
		},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := New(tt.cfg, nil, nil)
			if err == nil {
				t.Fatal("New succeeded")
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("error %v is not %v", err, tt.is)
			}
			for _, w := range tt.mention {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

// TestDNSSettings: a setting comes from config, then config's _file, then
// the environment, then the environment's _FILE; missing required ones and
// unreadable files are errors naming the setting.
func TestDNSSettings(t *testing.T) {
	secret := writeTemp(t, "secret", "from-file\n")
	tests := map[string]struct {
		creds   map[string]string
		env     map[string]string
		want    string
		wantErr string
	}{
		"config":          {creds: map[string]string{"api_token": "cfg"}, env: map[string]string{"CLOUDFLARE_API_TOKEN": "env"}, want: "cfg"},
		"config file":     {creds: map[string]string{"api_token_file": secret}, want: "from-file"},
		"env":             {env: map[string]string{"CLOUDFLARE_API_TOKEN": "env"}, want: "env"},
		"env file":        {env: map[string]string{"CLOUDFLARE_API_TOKEN_FILE": secret}, want: "from-file"},
		"missing":         {wantErr: "setting api_token is required"},
		"unreadable file": {env: map[string]string{"CLOUDFLARE_API_TOKEN_FILE": "/nonexistent/x"}, wantErr: "$CLOUDFLARE_API_TOKEN_FILE"},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			cfg := Config{DNSProvider: DNSCloudflare, DNSCredentials: tt.creds, getenv: fakeEnv(tt.env)}
			p, err := newDNSProvider(cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), "dns-provider cloudflare") {
					t.Fatalf("err = %v, want one mentioning %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := p.(*cloudflare).apiToken; got != tt.want {
				t.Errorf("api_token = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestRFC2136Settings(t *testing.T) {
	_, err := newDNSProvider(Config{DNSProvider: DNSRFC2136, getenv: fakeEnv(map[string]string{
		"RFC2136_NAMESERVER": "127.0.0.1", "RFC2136_TSIG_KEY": "k", "RFC2136_TSIG_SECRET": "c2VjcmV0", "RFC2136_TSIG_ALGORITHM": "md5",
	})})
	if err == nil || !strings.Contains(err.Error(), "tsig_algorithm") {
		t.Fatalf("err = %v, want one naming tsig_algorithm", err)
	}
	p, err := newDNSProvider(Config{DNSProvider: DNSRFC2136, getenv: fakeEnv(map[string]string{"RFC2136_NAMESERVER": "127.0.0.1"})})
	if err != nil {
		t.Fatal(err)
	}
	if got := p.(*rfc2136).server; got != "127.0.0.1:53" {
		t.Errorf("server = %q, want port 53 added", got)
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }
