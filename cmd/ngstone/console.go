package main

import (
	"context"
	"fmt"
	"image/color"
	"strings"
	"sync"
	"time"

	tea "charm.land/bubbletea/v2"
	"charm.land/lipgloss/v2"
	"github.com/charmbracelet/x/ansi"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/mux"
)

// The console is the agent's screen on a terminal, as ngrok's: one screen
// redrawn in place (bubbletea's inline renderer, so the last state stays
// on the terminal after exit), with the state and the truth about
// reconnects, the edge and its latency, the inspector's URL, each
// Forwarding URL, connection counters and the last requests. It owns
// stdout; while stderr is the same terminal, warnings and errors of the
// log are shown in it instead of being written over it.

// consoleView runs the agent under the console.
type consoleView struct {
	version string
	note    string    // a line about the setup (the embedded edge's CA)
	events  *eventLog // log records shown in the console; nil: they go to stderr
	refresh time.Duration
	keys    bool // read keys from stdin (a terminal)

	changed chan struct{} // a change of status to draw
}

func newConsoleView(version string, events *eventLog, refresh time.Duration, keys bool) *consoleView {
	return &consoleView{version: version, events: events, refresh: refresh, keys: keys, changed: make(chan struct{}, 1)}
}

func (v *consoleView) setNote(s string) { v.note = s }

// update is the agent's OnStatus: it never blocks.
func (v *consoleView) update(agent.Status) {
	select {
	case v.changed <- struct{}{}:
	default:
	}
}

func (v *consoleView) run(ctx context.Context, a *agent.Agent) error {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	m := &consoleModel{view: v, a: a, stop: stop, width: 120, height: 40}
	m.snapshot()
	opts := []tea.ProgramOption{tea.WithoutSignalHandler(), tea.WithFPS(20)}
	if !v.keys {
		opts = append(opts, tea.WithInput(nil))
	}
	p := tea.NewProgram(m, opts...)
	done := make(chan error, 1)
	go func() {
		err := exitFor(a.Run(ctx))
		done <- err
		p.Send(doneMsg{err: err})
	}()
	go func() {
		for {
			select {
			case <-v.changed:
				p.Send(changedMsg{})
			case <-ctx.Done():
				return
			}
		}
	}()
	if _, perr := p.Run(); perr != nil {
		stop() // the screen failed: the agent stops rather than run unseen
		err := <-done
		if err == nil {
			err = withCode(exitError, fmt.Errorf("console: %w", perr))
		}
		return err
	}
	return <-done
}

type (
	tickMsg    time.Time
	changedMsg struct{}
	doneMsg    struct{ err error }
)

// consoleModel is the bubbletea model: a snapshot of the agent, redrawn
// on every change of status and every refresh tick.
type consoleModel struct {
	view *consoleView
	a    *agent.Agent
	stop context.CancelFunc

	width, height int
	now           time.Time
	st            agent.Status
	stats         agent.Stats
	stopping      bool
	done          bool
	exit          int
}

func (m *consoleModel) Init() tea.Cmd { return m.tick() }

func (m *consoleModel) tick() tea.Cmd {
	return tea.Tick(m.view.refresh, func(t time.Time) tea.Msg { return tickMsg(t) })
}

func (m *consoleModel) snapshot() {
	m.now, m.st, m.stats = time.Now(), m.a.Status(), m.a.Stats()
}

func (m *consoleModel) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case tickMsg:
		m.snapshot()
		return m, m.tick()
	case changedMsg:
		m.snapshot()
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
	case tea.KeyPressMsg:
		if msg.String() == "ctrl+c" {
			m.stopping = true
			m.stop()
		}
	case doneMsg:
		m.snapshot()
		m.done, m.exit = true, exitCodeOf(msg.err)
		return m, tea.Quit
	}
	return m, nil
}

func (m *consoleModel) View() tea.View {
	return tea.NewView(m.render())
}

var (
	styleTitle = lipgloss.NewStyle().Bold(true).Foreground(lipgloss.Cyan)
	styleDim   = lipgloss.NewStyle().Foreground(lipgloss.BrightBlack)
	styleHead  = lipgloss.NewStyle().Bold(true)
	styleHint  = lipgloss.NewStyle().Foreground(lipgloss.Yellow)
	styleErr   = lipgloss.NewStyle().Foreground(lipgloss.Red)
)

func stateColor(s agent.State) color.Color {
	switch s {
	case agent.StateOnline:
		return lipgloss.Green
	case agent.StateConnecting, agent.StateReconnecting:
		return lipgloss.Yellow
	case agent.StateStopped:
		return lipgloss.BrightBlack
	}
	return lipgloss.Red
}

func statusColor(code int) color.Color {
	switch {
	case code >= 500 || code == 0:
		return lipgloss.Red
	case code >= 400:
		return lipgloss.Yellow
	case code >= 300:
		return lipgloss.Cyan
	}
	return lipgloss.Green
}

// labelWidth is the width of the field names, as ngrok's.
const labelWidth = 30

// render draws the screen: every line cut to the terminal's width, the
// list of requests cut so that the whole fits its height, and the whole as
// high as the terminal (less a line for the shell's prompt after exit),
// so that the inline renderer redraws the same lines in place instead of
// scrolling a taller frame into the terminal's history.
func (m *consoleModel) render() string {
	var top []string
	add := func(label, value string) {
		top = append(top, fmt.Sprintf("%-*s%s", labelWidth, label, value))
	}
	addWrapped := func(label, value string, style lipgloss.Style) {
		for i, l := range wrap(value, max(20, m.width-labelWidth), 3) {
			if i > 0 {
				label = ""
			}
			add(label, style.Render(l))
		}
	}
	title := styleTitle.Render("ngstone")
	help := styleDim.Render("(Ctrl+C to quit)")
	if m.stopping && !m.done {
		help = styleHint.Render("stopping: unbinding, letting requests in flight finish")
	}
	top = append(top, title+strings.Repeat(" ", max(1, m.width-ansi.StringWidth(title)-ansi.StringWidth(help)))+help, "")
	st := m.st
	add("Session Status", lipgloss.NewStyle().Foreground(stateColor(st.State)).Render(m.stateText()))
	switch {
	case st.State == agent.StateEvicted:
		reason := st.EvictedReason
		if reason == "" {
			reason = "takeover"
		}
		addWrapped("Evicted By", fmt.Sprintf("%s took %s over while this one was unreachable (%s)", takenBy(st.EvictedBy), st.Hostname, reason), styleErr)
	case st.Err != nil && st.State != agent.StateOnline && st.State != agent.StateStopped:
		addWrapped("Last Error", st.Err.Error(), styleErr)
	}
	if st.Hint != "" {
		addWrapped("What to do", st.Hint, styleHint)
	}
	edge := st.Edge
	switch {
	case st.Latency > 0 && st.State == agent.StateOnline:
		edge += styleDim.Render(" · latency ") + fmtDuration(st.Latency)
	case st.Latency > 0:
		edge += styleDim.Render(" · latency " + fmtDuration(st.Latency) + " when last online")
	}
	add("Edge", edge)
	add("Version", m.view.version)
	add("Instance", st.InstanceID+styleDim.Render(" (a digest: what the edge's admin API shows)"))
	web := st.InspectURL
	if web == "" {
		web = styleDim.Render("off")
	}
	add("Web Interface", web)
	endpoints := st.Endpoints()
	for _, t := range endpoints {
		line := t.PublicURL + " -> " + t.Local
		if t.VerifyWebhook != "" {
			line += styleDim.Render(" (" + t.VerifyWebhook + " webhooks only)")
		}
		if t.OAuth != "" {
			line += styleDim.Render(" (" + t.OAuth + " sign-in)")
		}
		switch {
		case t.Pool && t.Down != "":
			line += styleDim.Render(" (pool member, out: " + t.Down + ")")
		case t.Pool:
			line += styleDim.Render(" (pool member)")
		}
		if len(st.Tunnels) > 1 {
			line = t.Tunnel + ": " + line
		}
		if st.State != agent.StateOnline {
			line = styleDim.Render(line + " (offline until reconnected)")
		}
		add("Forwarding", line)
	}
	if len(endpoints) == 0 {
		add("Forwarding", styleDim.Render(m.noURL()))
	}
	if len(st.Tunnels) > 1 && len(endpoints) > 0 {
		// The names this agent no longer serves, while others go on.
		for _, t := range st.Tunnels {
			switch t.State {
			case agent.TunnelRefused:
				addWrapped("Refused", t.Name+": "+agent.ErrText(t.Err), styleErr)
			case agent.TunnelEvicted:
				addWrapped("Evicted", fmt.Sprintf("%s: %s took %s over while this one was unreachable", t.Name, takenBy(t.EvictedBy), t.Hostname), styleErr)
			}
		}
	}
	if m.view.note != "" {
		add("", styleDim.Render(m.view.note))
	}
	top = append(top, "")
	top = append(top, m.connections()...)
	if ev := m.events(); len(ev) > 0 {
		top = append(top, "", styleHead.Render("Messages"))
		top = append(top, ev...)
	}
	head := requestsHeading(endpoints)
	top = append(top, "", styleHead.Render(head), styleDim.Render(strings.Repeat("-", len(head))))
	lines := append(top, m.requests(m.height-len(top)-1)...)
	for i, l := range lines {
		lines[i] = ansi.Truncate(l, m.width, "…")
	}
	rows := max(1, m.height-1)
	if len(lines) > rows {
		lines = lines[:rows]
	}
	for len(lines) < rows {
		lines = append(lines, "")
	}
	return strings.Join(lines, "\n")
}

// requestsHeading names what the list under it shows: ngrok's "HTTP
// Requests", "Connections" for TCP and TLS tunnels only, or both.
func requestsHeading(endpoints []agent.Endpoint) string {
	var http, relay bool
	for _, e := range endpoints {
		if e.Proto == "tcp" || e.Proto == "tls" {
			relay = true
		} else {
			http = true
		}
	}
	switch {
	case relay && http:
		return "Requests and Connections"
	case relay:
		return "Connections"
	}
	return "HTTP Requests"
}

// takenBy names the agent that took a name over, as far as the edge said:
// one of this token by its instance (and address), one of another token
// as only that, and, from an edge that says nothing, another instance.
func takenBy(by mux.Holder) string {
	switch s := by.String(); {
	case by.OtherToken:
		return s
	case s != "":
		return "another agent (" + s + ")"
	}
	return "another agent (another instance)"
}

func (m *consoleModel) stateText() string {
	st := m.st
	since := func(t time.Time) string {
		return "since " + t.Format(time.TimeOnly) + " (" + fmtAge(m.now.Sub(t)) + ")"
	}
	switch st.State {
	case agent.StateOnline:
		return "online · " + since(st.Since)
	case agent.StateReconnecting:
		next := max(0, st.NextRetry.Sub(m.now))
		return fmt.Sprintf("reconnecting · attempt %d · next try in %s · offline %s", st.Attempt, next.Round(100*time.Millisecond), since(st.Since))
	case agent.StateConnecting:
		return "connecting to " + st.Edge
	case agent.StateEvicted:
		return "evicted at " + st.Since.Format(time.TimeOnly) + m.exitText()
	case agent.StateFailed:
		return "refused by the edge" + m.exitText()
	case agent.StateStopped:
		return "stopped" + m.exitText()
	}
	return string(st.State)
}

func (m *consoleModel) exitText() string {
	if !m.done {
		return ""
	}
	return fmt.Sprintf(" · exit code %d", m.exit)
}

func (m *consoleModel) noURL() string {
	switch m.st.State {
	case agent.StateEvicted:
		return "none: this agent no longer serves the name"
	case agent.StateFailed, agent.StateStopped:
		return "none"
	}
	return "none yet"
}

func (m *consoleModel) connections() []string {
	s := m.stats
	q := func(d time.Duration) string {
		if d < 0 {
			return "-"
		}
		return fmtDuration(d)
	}
	head := fmt.Sprintf("%-*s%-8s%-8s%-8s%-8s%-10s%-10s", labelWidth, "Connections", "ttl", "opn", "rt1", "rt5", "p50", "p90")
	row := fmt.Sprintf("%-*s%-8d%-8d%-8.2f%-8.2f%-10s%-10s", labelWidth, "", s.Total, s.Open, s.Rate1, s.Rate5, q(s.P50), q(s.P90))
	return []string{styleHead.Render(head), row}
}

// requests lists the last requests that fit in n lines, newest first.
func (m *consoleModel) requests(n int) []string {
	var out []string
	for _, r := range m.stats.Recent {
		if len(out) >= n {
			break
		}
		status := "-"
		if r.Status != 0 {
			status = fmt.Sprintf("%d", r.Status)
		}
		if r.Code != "" {
			status += " " + r.Code
		}
		method := r.Method
		if r.Replay {
			method = "↻ " + method
		}
		path := r.Path
		if r.Tunnel != "" {
			path = r.Tunnel + ": " + path
		}
		path = ansi.Truncate(path, max(10, m.width-labelWidth-40), "…")
		out = append(out, fmt.Sprintf("%-14s%-8s%-*s%s %s",
			r.Start.Format("15:04:05.000"), method, max(10, m.width-labelWidth-40)+2, path,
			lipgloss.NewStyle().Foreground(statusColor(r.Status)).Render(fmt.Sprintf("%-28s", status)), fmtDuration(r.Duration)))
	}
	return out
}

func (m *consoleModel) events() []string {
	if m.view.events == nil {
		return nil
	}
	var out []string
	for _, e := range m.view.events.last(consoleEvents) {
		out = append(out, styleHint.Render(e))
	}
	return out
}

// wrap cuts s into lines of at most width cells, at most n of them, at
// spaces only: ansi's word wrap also breaks at hyphens, which would cut a
// flag (--control-addr) the line tells a person to type.
func wrap(s string, width, n int) []string {
	var lines []string
	line := ""
	for _, w := range strings.Fields(s) {
		switch {
		case line == "":
			line = w
		case ansi.StringWidth(line)+1+ansi.StringWidth(w) <= width:
			line += " " + w
		default:
			lines, line = append(lines, line), w
		}
	}
	lines = append(lines, line)
	for i, l := range lines {
		lines[i] = ansi.Truncate(l, width, "…")
	}
	if len(lines) > n {
		lines = append(lines[:n-1], ansi.Truncate(strings.Join(lines[n-1:], " "), width, "…"))
	}
	return lines
}

func fmtDuration(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%dµs", d.Microseconds())
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}

func fmtAge(d time.Duration) string { return d.Round(time.Second).String() }

// consoleEvents is how many log records the console shows.
const consoleEvents = 4

// eventLog keeps the last log lines for the console.
type eventLog struct {
	mu    sync.Mutex
	lines []string
	keep  int
}

func newEventLog(keep int) *eventLog { return &eventLog{keep: keep} }

func (e *eventLog) Write(p []byte) (int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, l := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
		if len(e.lines) == e.keep {
			e.lines = append(e.lines[:0], e.lines[1:]...)
		}
		e.lines = append(e.lines, l)
	}
	return len(p), nil
}

func (e *eventLog) last(n int) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.lines[max(0, len(e.lines)-n):]...)
}
