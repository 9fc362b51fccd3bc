package main

import (
	"io"
	stdlog "log"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/lmittmann/tint"

	"github.com/ngstone/ngstone/config"
)

// isTerminal reports whether f is a character device (a terminal).
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// newLogger logs to w: coloured text on a terminal (plain if NO_COLOR is
// set), JSON otherwise or when the format says so.
func newLogger(lc config.Log, w *os.File) *slog.Logger {
	var level slog.Level
	level.UnmarshalText([]byte(lc.Level))
	format := lc.Format
	if format == "" {
		format = "json"
		if isTerminal(w) {
			format = "text"
		}
	}
	log := slog.New(handler(format, level, w, isTerminal(w)))
	stdlog.SetFlags(0)
	stdlog.SetOutput(&stdlogWriter{log: log})
	return log
}

// newConsoleLogger keeps the log's warnings and errors (or what lc asks
// for above those) in events, for the console to show: the console owns
// the terminal stderr would write to.
func newConsoleLogger(lc config.Log, events io.Writer) *slog.Logger {
	level := slog.LevelWarn
	var asked slog.Level
	if asked.UnmarshalText([]byte(lc.Level)) == nil && asked > level {
		level = asked
	}
	log := slog.New(tint.NewTextHandler(events, &tint.Options{Level: level, TimeFormat: time.TimeOnly, NoColor: true}))
	stdlog.SetFlags(0)
	stdlog.SetOutput(&stdlogWriter{log: log})
	return log
}

// stdlogWriter takes what libraries print with the standard logger into
// the structured log. net/http's transport prints each response a local
// service sent unasked on an idle connection, with its first bytes, which
// may be another visitor's data. Its own check is what finds them on a
// machine that is not busy (the agent's finds them when the transport's
// comes too late), so each becomes the agent's warning, without the
// bytes, at most every strayWarnEvery.
type stdlogWriter struct {
	log *slog.Logger

	mu      sync.Mutex
	strayAt time.Time // of the last warning of stray bytes
	unsaid  int       // stray bytes not warned of since
}

// strayWarnEvery bounds the warnings of stray bytes, as the agent's own.
const strayWarnEvery = 10 * time.Second

func (w *stdlogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if !strings.HasPrefix(msg, "Unsolicited response received on idle HTTP channel") {
		w.log.Warn(msg, "from", "net/http")
		return len(p), nil
	}
	w.mu.Lock()
	due, unsaid := time.Since(w.strayAt) >= strayWarnEvery, w.unsaid
	if due {
		w.strayAt, w.unsaid = time.Now(), 0
	} else {
		w.unsaid++
	}
	w.mu.Unlock()
	if due {
		w.log.Warn("the local service sent bytes nobody asked for (a body after HEAD, 204 or 304, or past its Content-Length): that connection was closed, and no visitor got them",
			"from", "net/http", "times_not_logged", unsaid)
	}
	return len(p), nil
}

func handler(format string, level slog.Level, w io.Writer, tty bool) slog.Handler {
	if format == "json" {
		return slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})
	}
	_, noColor := os.LookupEnv("NO_COLOR")
	return tint.NewTextHandler(w, &tint.Options{Level: level, TimeFormat: time.TimeOnly, NoColor: noColor || !tty})
}
