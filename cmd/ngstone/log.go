package main

import (
	"io"
	stdlog "log"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/lmittmann/tint"

	"github.com/ngstone/ngstone/agent"
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
	stdlog.SetOutput(newStdlogWriter(log))
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
	stdlog.SetOutput(newStdlogWriter(log))
	return log
}

// stdlogWriter takes what libraries print with the standard logger into
// the structured log. net/http's transport prints each response a local
// service sent unasked on an idle connection, with its first bytes, which
// may be another visitor's data: each becomes the agent's warning of stray
// bytes, without them (agent.StrayWarner).
type stdlogWriter struct {
	log    *slog.Logger
	strays *agent.StrayWarner
}

func newStdlogWriter(log *slog.Logger) *stdlogWriter {
	return &stdlogWriter{log: log, strays: agent.NewStrayWarner(log)}
}

func (w *stdlogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if strings.HasPrefix(msg, "Unsolicited response received on idle HTTP channel") {
		w.strays.Warn()
	} else {
		w.log.Warn(msg, "from", "net/http")
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
