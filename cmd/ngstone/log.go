package main

import (
	"io"
	"log/slog"
	"os"
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
	return slog.New(handler(format, level, w, isTerminal(w)))
}

func handler(format string, level slog.Level, w io.Writer, tty bool) slog.Handler {
	if format == "json" {
		return slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})
	}
	_, noColor := os.LookupEnv("NO_COLOR")
	return tint.NewHandler(w, &tint.Options{Level: level, TimeFormat: time.TimeOnly, NoColor: noColor || !tty})
}
