package main

import (
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

// TestWriteMemStats: what SIGUSR1 writes beside the heap profile names
// the heap in use, the stacks and the resident set, each with a number,
// and the heap in use is more than a buffer this test holds.
func TestWriteMemStats(t *testing.T) {
	held := make([]byte, 8<<20)
	for i := range held {
		held[i] = byte(i)
	}
	path := filepath.Join(t.TempDir(), "agent-memstats.txt")
	writeMemStats(path)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string]string{}
	for line := range strings.Lines(string(b)) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), " "); ok {
			fields[strings.TrimSuffix(k, ":")] = strings.TrimSpace(v)
		}
	}
	for _, k := range []string{"goroutines", "HeapInuse", "StackInuse", "NextGC", "VmHWM", "RssAnon", "RssFile"} {
		if fields[k] == "" {
			t.Errorf("%s missing from %q", k, b)
		}
	}
	inuse, err := strconv.ParseUint(fields["HeapInuse"], 10, 64)
	if err != nil || inuse < uint64(len(held)) {
		t.Errorf("HeapInuse %q, want at least the %d bytes held", fields["HeapInuse"], len(held))
	}
	runtime.KeepAlive(held)
}
