package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"go.yaml.in/yaml/v3"

	"github.com/ngstone/ngstone/edge"
)

// tokensFile is the layout of --tokens-file:
//
//	tokens:
//	  - token: s3cret            # required
//	    name: team-a             # for logs
//	    subdomains: [team-a-*]   # names it may bind (path.Match patterns); empty: any
//	    hostnames: ["*.team-a.example"]  # hostnames of its own it may bind (--hostname); empty: none
//	    max_sessions: 5          # concurrent agents; 0: no limit
//	    max_bindings: 10         # tunnels; 0: no limit
//	    tcp_ports: ["20000-20009", 22022]  # TCP tunnels' ports it may hold; empty: any of --tcp-ports
type tokensFile struct {
	Tokens []edge.TokenPolicy `yaml:"tokens"`
}

// LoadTokensFile reads and validates a tokens file.
func LoadTokensFile(path string) ([]edge.TokenPolicy, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokens-file: %w", err)
	}
	pol, err := ParseTokens(b)
	if err != nil {
		return nil, fmt.Errorf("tokens-file %s: %w", path, err)
	}
	return pol, nil
}

// ParseTokens parses the YAML of a tokens file. Unknown keys are errors, so
// a misspelt limit is not silently ignored.
func ParseTokens(b []byte) ([]edge.TokenPolicy, error) {
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	var f tokensFile
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	for i := range f.Tokens {
		if err := f.Tokens[i].Validate(i); err != nil {
			return nil, err
		}
	}
	return f.Tokens, nil
}
