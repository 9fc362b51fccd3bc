package main

import (
	"bufio"
	"cmp"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
)

// Counting one exchange's goroutine work in an execution trace (-tracecount,
// for the traces a role writes on SIGUSR2). go tool trace -d=parsed prints
// each event, and the stacks of a state transition, as text; the counts are
// of goroutine state transitions, divided by the number of exchanges: the
// transitions that match -traceunit, as FROM->TO followed by the stacks: a
// step every exchange takes once (the agent: yamux's incomingStream waking
// the goroutine waiting for a stream; the edge: net/http starting its
// background read's goroutine).

// traceEvent is a goroutine state transition: from, to, and its stacks.
type traceEvent struct {
	from, to, reason string
	stack            string
}

var transition = regexp.MustCompile(`^M=-?\d+ P=-?\d+ G=-?\d+ StateTransition Time=\d+ GoID=\d+ (\w+)->(\w+) Reason="([^"]*)"`)

// readTransitions parses go tool trace -d=parsed's output, calling each
// with every goroutine state transition.
func readTransitions(r io.Reader, each func(traceEvent)) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var cur *traceEvent
	var stack strings.Builder
	flush := func() {
		if cur != nil {
			cur.stack = stack.String()
			each(*cur)
		}
		cur = nil
		stack.Reset()
	}
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "M=") {
			if cur != nil {
				stack.WriteString(line)
				stack.WriteByte('\n')
			}
			continue
		}
		flush()
		if m := transition.FindStringSubmatch(line); m != nil && m[1] != "Undetermined" {
			cur = &traceEvent{from: m[1], to: m[2], reason: m[3]}
		}
	}
	flush()
	return sc.Err()
}

// syscallKinds name a syscall by a frame of its stack, first match.
var syscallKinds = []struct{ name, frame string }{
	{"tunnel read", `mux.(*batchedConn).Read`},
	{"tunnel write", `mux.(*batchedConn).uncork`},
	{"visitor read: net/http's background read", `net/http.(*connReader).backgroundRead`},
	{"visitor read: the request", `net/http.(*connReader).Read`},
	{"visitor write", `net/http.checkConnErrorWriter.Write`},
	{"local service: clean check (peek)", `agent.(*watchedUnix).peekFd`},
	{"local service read", `net/http.(*persistConn).Read`},
	{"local service write", `net/http.(*persistConn).writeLoop`},
}

// traceCount prints, per exchange, the goroutine work in the trace at path.
func traceCount(w io.Writer, path, unit string) error {
	unitRE, err := regexp.Compile(unit)
	if err != nil {
		return fmt.Errorf("-traceunit: %w", err)
	}
	cmd := exec.Command("go", "tool", "trace", "-d=parsed", path)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("go tool trace: %w", err)
	}
	var n float64
	counts := map[string]float64{}
	kinds := map[string]float64{}
	waits := map[string]float64{}
	err = readTransitions(out, func(e traceEvent) {
		if unitRE.MatchString(e.from + "->" + e.to + " " + e.stack) {
			n++
		}
		if strings.Contains(e.stack, "runtime/trace.") || strings.Contains(e.stack, "main.traceOnUSR2") {
			return // the tracer's own
		}
		switch {
		case e.from == "NotExist":
			counts["goroutines started"]++
		case e.to == "Waiting":
			counts["waits (each ended by a wake-up)"]++
			waits[waitPlace(e)]++
		case e.to == "Syscall":
			counts["syscalls"]++
			kinds[syscallKind(e.stack)]++
		case e.to == "Runnable" && e.reason == "runtime.Gosched":
			counts["yields (runtime.Gosched: the GC's sweeper)"]++
		}
	})
	if werr := cmd.Wait(); err == nil && werr != nil {
		err = fmt.Errorf("go tool trace: %w", werr)
	}
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("no transition's stack matches -traceunit %q", unit)
	}
	fmt.Fprintf(w, "%s: %.0f exchanges\n", path, n)
	for _, k := range []string{"goroutines started", "waits (each ended by a wake-up)", "syscalls", "yields (runtime.Gosched: the GC's sweeper)"} {
		fmt.Fprintf(w, "  %6.2f  %s\n", counts[k]/n, k)
	}
	for _, k := range syscallKinds {
		if v := kinds[k.name]; v > 0 {
			fmt.Fprintf(w, "  %6.2f    %s\n", v/n, k.name)
		}
	}
	if v := kinds["other"]; v > 0 {
		fmt.Fprintf(w, "  %6.2f    other\n", v/n)
	}
	fmt.Fprintln(w, "  waits, by where:")
	places := slices.Collect(maps.Keys(waits))
	slices.SortFunc(places, func(a, b string) int { return cmp.Compare(waits[b], waits[a]) })
	for _, p := range places {
		if waits[p]/n >= 0.05 {
			fmt.Fprintf(w, "  %6.2f    %s\n", waits[p]/n, p)
		}
	}
	return nil
}

// waitPlace names where a goroutine waited: the reason and the first two
// frames of its stack outside the runtime.
func waitPlace(e traceEvent) string {
	var frames []string
	for line := range strings.SplitSeq(e.stack, "\n") {
		fn, _, ok := strings.Cut(strings.TrimSpace(line), " @ 0x")
		if !ok || strings.HasPrefix(fn, "runtime.") || strings.HasPrefix(fn, "internal/") || strings.HasPrefix(fn, "sync.") {
			continue
		}
		fn = strings.TrimPrefix(strings.TrimPrefix(fn, "github.com/ngstone/ngstone/"), "github.com/hashicorp/")
		if len(frames) == 0 || frames[len(frames)-1] != fn {
			frames = append(frames, fn)
		}
		if len(frames) == 2 {
			break
		}
	}
	return e.reason + ": " + strings.Join(frames, " < ")
}

func syscallKind(stack string) string {
	for _, k := range syscallKinds {
		if strings.Contains(stack, k.frame) {
			return k.name
		}
	}
	return "other"
}
