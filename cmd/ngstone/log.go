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

// stdlogWriter takes what libraries print with the standard logger into
// the structured log. net/http's transport prints each response a local
// service sent unasked on an idle connection, with its first bytes, which
// may be another visitor's data: that becomes one warning without them,
// at most one every 10 s.
type stdlogWriter struct {
	log *slog.Logger

	mu     sync.Mutex
	last   time.Time
	unsaid int
}

func (w *stdlogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if !strings.HasPrefix(msg, "Unsolicited response received on idle HTTP channel") {
		w.log.Warn(msg, "from", "net/http")
		return len(p), nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if now := time.Now(); now.Sub(w.last) >= 10*time.Second {
		w.log.Warn("the local service sent bytes nobody asked for on an idle connection (a body after HEAD, 204 or 304, or past its Content-Length); that connection was closed, and no visitor got them",
			"times_not_logged", w.unsaid)
		w.last, w.unsaid = now, 0
		return len(p), nil
	}
	w.unsaid++
	return len(p), nil
}

func handler(format string, level slog.Level, w io.Writer, tty bool) slog.Handler {
	if format == "json" {
		return slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})
	}
	_, noColor := os.LookupEnv("NO_COLOR")
	return tint.NewTextHandler(w, &tint.Options{Level: level, TimeFormat: time.TimeOnly, NoColor: noColor || !tty})
}
