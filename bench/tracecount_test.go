package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"runtime/trace"
	"strconv"
	"testing"
)

// tracedExchange is the unit of TestTraceCount: one goroutine, which
// waits once for its start.
func tracedExchange(start <-chan struct{}, done chan<- struct{}) {
	<-start
	close(done)
}

// TestTraceCount: a real execution trace of exchanges that each start one
// goroutine, read through go tool trace, counts as many exchanges as there
// were and at least one goroutine started for each.
func TestTraceCount(t *testing.T) {
	const exchanges = 40
	path := filepath.Join(t.TempDir(), "t.trace")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := trace.Start(f); err != nil {
		t.Fatal(err)
	}
	for range exchanges {
		start, done := make(chan struct{}), make(chan struct{})
		go tracedExchange(start, done)
		close(start)
		<-done
	}
	trace.Stop()
	f.Close()
	var out bytes.Buffer
	if err := traceCount(&out, path, `^NotExist->Runnable (?s:.*)\.tracedExchange @`); err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`: (\d+) exchanges\n\s+([0-9.]+)\s+goroutines started`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("no counts in:\n%s", out.String())
	}
	n, _ := strconv.Atoi(m[1])
	started, _ := strconv.ParseFloat(m[2], 64)
	if n < exchanges || started < 1 {
		t.Errorf("%d exchanges, %.2f goroutines started each, want %d and at least 1:\n%s", n, started, exchanges, out.String())
	}
}
