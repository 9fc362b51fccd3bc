package main

import (
	"strings"
	"testing"
)

// A few lines as perf script -F pid,ip,sym,dso prints them, of two
// measured processes (10 and 20) and one that is not (30).
const perfScript = `   10  ffffffff8225f8ab finish_task_switch.isra.0 ([kernel.kallsyms])
   10  4a1b2c crypto/internal/fips140/aes/gcm.gcmAesEnc.abi0 (/tmp/ngstone)
   10  4a1b2d runtime.memmove (/tmp/ngstone)
   10  ffffffff81369742 _copy_to_iter ([kernel.kallsyms])
   10  ffffffff82075b83 tcp_rearm_rto.part.0 ([kernel.kallsyms])
   10  4a1b2e runtime.findRunnable (/tmp/ngstone)
   10  4a1b2f github.com/hashicorp/yamux.(*Session).recvLoop (/tmp/ngstone)
   20  4a1b30 runtime.usleep.abi0 (/tmp/ngstone)
   20  4a1b31 net/http.(*conn).serve (/tmp/ngstone)
   30  4a1b32 runtime.memmove (/tmp/other)
    0  ffffffff8225f8ab pv_native_safe_halt ([kernel.kallsyms])
not a sample
`

func TestCountKinds(t *testing.T) {
	counts, err := countKinds(strings.NewReader(perfScript), map[int]bool{10: true, 20: true})
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]map[string]int{
		10: {cpuKinds[0]: 1, cpuKinds[1]: 1, cpuKinds[2]: 1, cpuKinds[3]: 1, cpuKinds[4]: 1, cpuKinds[5]: 1, cpuKinds[6]: 1},
		20: {cpuKinds[3]: 1, cpuKinds[6]: 1},
	}
	if len(counts) != len(want) {
		t.Fatalf("counted pids %v, want 10 and 20 only", counts)
	}
	for pid, w := range want {
		for k, n := range w {
			if counts[pid][k] != n {
				t.Errorf("pid %d, %s: %d samples, want %d (all: %v)", pid, k, counts[pid][k], n, counts[pid])
			}
		}
		if len(counts[pid]) != len(w) {
			t.Errorf("pid %d: kinds %v, want %v", pid, counts[pid], w)
		}
	}
}

// A Go function is never the kernel's, and the kernel's copies are not Go's.
func TestKindOfSides(t *testing.T) {
	for _, c := range []struct {
		sym    string
		kernel bool
		want   string
	}{
		{"memcpy_orig", true, cpuKinds[2]},
		{"main.memcpyish", false, cpuKinds[6]},
		{"runtime.memclrNoHeapPointers", false, cpuKinds[1]},
		{"tcp_sendmsg_locked", true, cpuKinds[5]},
		{"internal/runtime/syscall/linux.Syscall6", false, cpuKinds[4]},
	} {
		if got := kindOf(c.sym, c.kernel); got != c.want {
			t.Errorf("kindOf(%q, kernel %v) = %q, want %q", c.sym, c.kernel, got, c.want)
		}
	}
}

func TestSchemeProcs(t *testing.T) {
	p := &peer{procs: []*proc{{name: "relay http 1"}, {name: "relay https 1"}, {name: "mux edge http"}}}
	if got := procNames(p.schemeProcs("http")); got != "relay http 1 / mux edge http" {
		t.Errorf("http: %q", got)
	}
	if got := procNames(p.schemeProcs("https")); got != "relay https 1" {
		t.Errorf("https: %q", got)
	}
	frp := &peer{procs: []*proc{{name: "frps"}, {name: "frpc"}}}
	if got := procNames(frp.schemeProcs("http")); got != "frps / frpc" {
		t.Errorf("a peer with no process named for the scheme: %q, want all of them", got)
	}
}
