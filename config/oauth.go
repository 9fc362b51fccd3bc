package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/ngstone/ngstone/edge"
)

// The edge's oauth-providers: section holds the settings of each provider
// --oauth-provider names (its secrets stay on the edge):
//
//	oauth-provider: [google, github, corp]
//	oauth-providers:
//	  google:
//	    client-id: 1234.apps.googleusercontent.com
//	    client-secret-file: /run/secrets/google
//	  github:
//	    client-id: Iv1.abcd
//	    client-secret-file: /run/secrets/github
//	  corp:                        # any OIDC issuer
//	    issuer: https://sso.example.com
//	    client-id: ngstone
//	    client-secret-file: /run/secrets/corp
//	    scopes: [openid, email, groups]
//
// A provider named google or github is that provider unless it has an
// issuer; `kind: github` with auth-url, token-url and api-url is a GitHub
// Enterprise server.

type providerSettings struct {
	Kind             string   `yaml:"kind"`
	Issuer           string   `yaml:"issuer"`
	ClientID         string   `yaml:"client-id"`
	ClientSecretFile string   `yaml:"client-secret-file"`
	Scopes           []string `yaml:"scopes"`
	AuthURL          string   `yaml:"auth-url"`
	TokenURL         string   `yaml:"token-url"`
	APIURL           string   `yaml:"api-url"`
}

// oauthProviders reads the providers names selects from file's section.
func oauthProviders(file string, names []string) ([]edge.OAuthProvider, error) {
	if len(names) == 0 {
		return nil, nil
	}
	if file == "" {
		return nil, errors.New("oauth-provider: each provider's settings are in the oauth-providers: section of the file --config names")
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", file, err)
	}
	var doc struct {
		Providers map[string]yaml.Node `yaml:"oauth-providers"`
	}
	if err := yaml.NewDecoder(bytes.NewReader(b)).Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("config %s: %w", file, err)
	}
	var out []edge.OAuthProvider
	for _, name := range names {
		node, ok := doc.Providers[name]
		if !ok {
			return nil, fmt.Errorf("config %s: oauth-provider %s: no oauth-providers.%s section with its client-id and client-secret-file", file, name, name)
		}
		var s providerSettings
		dec := yaml.NewDecoder(bytes.NewReader(mustYAML(&node)))
		dec.KnownFields(true)
		if err := dec.Decode(&s); err != nil {
			return nil, fmt.Errorf("config %s: oauth-providers.%s: %w", file, name, err)
		}
		p := edge.OAuthProvider{Name: name, Kind: s.Kind, Issuer: s.Issuer, ClientID: s.ClientID, Scopes: s.Scopes,
			AuthURL: s.AuthURL, TokenURL: s.TokenURL, APIURL: s.APIURL}
		if p.Kind == "" {
			switch {
			case p.Issuer == "" && (name == edge.OAuthGoogle || name == edge.OAuthGitHub):
				p.Kind = name
			default:
				p.Kind = edge.OAuthOIDC
			}
		}
		if s.ClientSecretFile != "" {
			b, err := os.ReadFile(s.ClientSecretFile)
			if err != nil {
				return nil, fmt.Errorf("config %s: oauth-providers.%s.client-secret-file: %w", file, name, err)
			}
			p.ClientSecret = strings.TrimSpace(string(b))
		}
		out = append(out, p)
	}
	return out, nil
}

// mustYAML re-encodes a node, for a strict decode of its fields.
func mustYAML(n *yaml.Node) []byte {
	b, err := yaml.Marshal(n)
	if err != nil {
		return nil
	}
	return b
}
