package main

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/charmbracelet/x/ansi"

	"github.com/ngstone/ngstone/agent"
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
