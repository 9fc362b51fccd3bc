package config_test

import (
	"strings"
	"testing"

	"github.com/ngstone/ngstone/config"
)

func TestParseTokens(t *testing.T) {
	pol, err := config.ParseTokens([]byte("tokens:\n  - token: a\n    name: team\n    subdomains: [team-*]\n    max_sessions: 2\n    max_bindings: 3\n  - token: b\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(pol) != 2 || pol[0].Token != "a" || pol[0].Subdomains[0] != "team-*" || pol[0].MaxSessions != 2 || pol[0].MaxBindings != 3 || pol[1].Token != "b" {
		t.Fatalf("parsed %+v", pol)
	}
	for name, bad := range map[string]string{
		"unknown key":   "tokens:\n  - token: a\n    max_session: 2\n",
		"empty token":   "tokens:\n  - token: ''\n",
		"bad pattern":   "tokens:\n  - token: a\n    subdomains: ['[']\n",
		"negative":      "tokens:\n  - token: a\n    max_bindings: -1\n",
		"not a mapping": "- a\n- b\n",
	} {
		if _, err := config.ParseTokens([]byte(bad)); err == nil {
			t.Errorf("%s: accepted %q", name, bad)
		}
	}
}

// FuzzParseTokens: any input is either refused or yields policies that all
// have a token.
func FuzzParseTokens(f *testing.F) {
	f.Add([]byte("tokens:\n  - token: a\n    subdomains: [x-*]\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		pol, err := config.ParseTokens(b)
		if err != nil {
			return
		}
		for i, p := range pol {
			if strings.TrimSpace(p.Token) == "" || p.MaxBindings < 0 || p.MaxSessions < 0 {
				t.Fatalf("entry %d accepted invalid: %+v", i, p)
			}
		}
	})
}
