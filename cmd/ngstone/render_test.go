package main

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/charmbracelet/x/ansi"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/mux"
)

// TestConsoleRender: whatever the state and however many requests, the
// screen is exactly as high as the terminal less a line, no line is wider
// than it, and a hint is wrapped at spaces, never inside a flag.
func TestConsoleRender(t *testing.T) {
	now := time.Now()
	var recent []agent.Request
	for i := range 60 {
		recent = append(recent, agent.Request{Start: now, Method: "POST", Path: "/hook/" + strings.Repeat("x", i*3), Status: 200 + i%4*100, Duration: time.Millisecond})
	}
	hint := "is the edge running at tunnels.example.com:4443? Nothing is listening there (--edge is the edge's --control-addr)"
	for _, st := range []agent.Status{
		{State: agent.StateOnline, Edge: "tunnels.example.com:4443", URLs: []string{"https://a.example.com", "http://a.example.com"}, Local: "http://localhost:3000", Latency: time.Millisecond},
		{State: agent.StateReconnecting, Edge: "tunnels.example.com:4443", Attempt: 7, NextRetry: now.Add(3 * time.Second), Since: now.Add(-time.Minute),
			Err: errors.New("dial tunnels.example.com:4443: " + strings.Repeat("connection refused ", 20)), Hint: hint, URLs: []string{"https://a.example.com"}},
		{State: agent.StateEvicted, Hostname: "a.example.com", EvictedReason: "takeover"},
		{State: agent.StateEvicted, Hostname: "a.example.com", EvictedReason: "takeover",
			EvictedBy: mux.Holder{Instance: strings.Repeat("d", 32), Addr: "[2001:db8::1]:50123"}},
	} {
		for _, size := range [][2]int{{120, 40}, {80, 24}, {50, 10}} {
			m := &consoleModel{view: newConsoleView("v1", newEventLog(consoleEvents), time.Second, false), width: size[0], height: size[1], now: now, st: st,
				stats: agent.Stats{Total: 60, Recent: recent, P50: -1, P90: -1}}
			m.view.events.Write([]byte(strings.Repeat("a warning ", 30) + "\n"))
			lines := strings.Split(m.render(), "\n")
			if len(lines) != size[1]-1 {
				t.Errorf("%s at %dx%d: %d lines", st.State, size[0], size[1], len(lines))
			}
			for _, l := range lines {
				if w := ansi.StringWidth(l); w > size[0] {
					t.Errorf("%s at %dx%d: a line of %d cells: %q", st.State, size[0], size[1], w, l)
				}
			}
			if st.Hint != "" && size[0] == 120 {
				if s := m.render(); !strings.Contains(s, "--control-addr") || !strings.Contains(s, "(--edge") {
					t.Errorf("hint cut inside a flag:\n%s", s)
				}
			}
		}
	}
}

// TestConsoleEvictedBy: the Evicted By line (and a tunnel's Evicted line
// in an agent of several) names the agent that took the name as far as
// the edge told: of this token by its instance and address, of another
// token as only that, and, from an older edge that says nothing, as
// another instance.
func TestConsoleEvictedBy(t *testing.T) {
	d := strings.Repeat("d", 32)
	for _, tc := range []struct {
		by   mux.Holder
		want string
	}{
		{mux.Holder{}, "another agent (another instance) took a.example.com over while this one was unreachable (takeover)"},
		{mux.Holder{Instance: d}, "another agent (instance " + d + ") took a.example.com over while this one was unreachable (takeover)"},
		{mux.Holder{Instance: d, Addr: "192.0.2.7:50123"}, "another agent (instance " + d + " from 192.0.2.7:50123) took a.example.com over while this one was unreachable (takeover)"},
		{mux.Holder{OtherToken: true}, "an agent with another token took a.example.com over while this one was unreachable (takeover)"},
	} {
		evicted := agent.TunnelStatus{Name: "web", State: agent.TunnelEvicted, Hostname: "a.example.com", EvictedBy: tc.by}
		serving := agent.TunnelStatus{Name: "shop", State: agent.TunnelOnline, Hostname: "s.example.com", URLs: []string{"https://s.example.com"}}
		for _, st := range []agent.Status{
			{State: agent.StateEvicted, Hostname: "a.example.com", EvictedReason: "takeover", EvictedBy: tc.by},
			{State: agent.StateOnline, Tunnels: []agent.TunnelStatus{evicted, serving}},
		} {
			// Wide enough that no line wraps.
			m := &consoleModel{view: newConsoleView("v1", newEventLog(consoleEvents), time.Second, false), width: 400, height: 40, now: time.Now(), st: st,
				stats: agent.Stats{P50: -1, P90: -1}}
			want := "Evicted By                    " + tc.want
			if st.State == agent.StateOnline {
				want = "Evicted                       web: " + strings.TrimSuffix(tc.want, " (takeover)")
			}
			if s := ansi.Strip(m.render()); !strings.Contains(s, want) {
				t.Errorf("by %+v: want %q in\n%s", tc.by, want, s)
			}
		}
	}
}

// TestConsoleRequestsHeading: the list's heading says what it lists: HTTP
// requests, a TCP or TLS tunnel's connections, or both.
func TestConsoleRequestsHeading(t *testing.T) {
	for want, urls := range map[string][]string{
		"HTTP Requests":            {"https://a.example.com", "http://a.example.com"},
		"Connections":              {"tcp://example.com:20022"},
		"Requests and Connections": {"https://a.example.com", "tls://b.example.com"},
	} {
		st := agent.Status{State: agent.StateOnline, Tunnels: []agent.TunnelStatus{{Name: "t", State: agent.TunnelOnline, URLs: urls}}}
		m := &consoleModel{view: newConsoleView("v1", newEventLog(consoleEvents), time.Second, false), width: 120, height: 40, now: time.Now(), st: st}
		if s := ansi.Strip(m.render()); !strings.Contains(s, "\n"+want+"\n") {
			t.Errorf("%v: no %q heading in\n%s", urls, want, s)
		}
	}
}
