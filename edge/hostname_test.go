package edge_test

import (
	"strings"
	"testing"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestNumericHostnamesRefused: under a token's broadest hostnames pattern
// ("*"), a hostname a browser's URL parser reads as an IPv4 address (its
// last label, or the one before an empty last one, is all digits or 0x
// and hex: WHATWG's "ends in a number") is refused invalid_name, by the
// edge from a hand-made bind and by the agent before it connects. Names
// with such a label elsewhere are names.
func TestNumericHostnamesRefused(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.TokenPolicies = []edge.TokenPolicy{{Token: "t", Hostnames: []string{"*.*"}}}
	e := tunneltest.StartEdge(t, cfg)
	for host, want := range map[string]string{
		"1.2.3":            mux.CodeInvalidName,
		"0x7f.0.0.1":       mux.CodeInvalidName,
		"app.0x7f":         mux.CodeInvalidName,
		"app.0X":           mux.CodeInvalidName,
		"app.017":          mux.CodeInvalidName,
		"app.123.":         mux.CodeInvalidName,
		"-app.example.org": mux.CodeInvalidName,
		"0x7f.example.org": "",
		"123.example.org":  "",
		"app.b1":           "",
		"app.0xg":          "",
	} {
		raw, m := e.DialRaw(t, hello("t"))
		if m.MessageType() != mux.TypeHelloOK {
			t.Fatalf("hello: %v", m)
		}
		got := ""
		if be, ok := raw.Bind(t, &mux.Bind{Hostname: host}).(*mux.BindError); ok {
			got = be.Code
		}
		if got != want {
			t.Errorf("bind of %s: %q, want %q", host, got, want)
		}
		ac := e.AgentConfig("", "127.0.0.1:1")
		ac.Token, ac.Hostname = "t", host
		_, err := agent.New(ac, tunneltest.Logger())
		if refused := err != nil && strings.Contains(err.Error(), "hostname"); refused != (want != "") {
			t.Errorf("agent with --hostname %s: %v, want refused %v", host, err, want != "")
		}
	}
}
