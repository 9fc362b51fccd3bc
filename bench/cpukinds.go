package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Where a transfer's CPU goes, by kind (-cpukinds): perf samples the
// measured processes while each transfer runs, kernel and user alike, and
// each sample is put in a kind by the function it landed in. A kind's
// share of the samples times the process's CPU per GiB (from /proc, as the
// other rows) is its row. Samples that land where interrupts are enabled
// again (finish_task_switch, the unlock after a wake-up) carry the cost of
// the switch or wake-up that ran with them off: on a VM the timer cannot
// interrupt it.

// The kinds, in the order they are printed.
var cpuKinds = []string{
	"crypto",
	"copies in Go",
	"copies in the kernel",
	"switches, wake-ups, spinning",
	"Go runtime, other",
	"kernel, other (TCP, syscalls)",
	"Go, other (HTTP, yamux, TLS framing)",
}

var (
	cryptoSym = regexp.MustCompile(`gcmAes|aes\.|gcm\.|ghash|chacha|poly1305`)
	goCopySym = regexp.MustCompile(`^runtime\.(memmove|memclr)`)
	kCopySym  = regexp.MustCompile(`copy_from_iter|copy_to_iter|copy_user|rep_movs|memcpy`)
	switchSym = regexp.MustCompile(`finish_task_switch|spin_unlock_irq|^schedule|__schedule|futex|try_to_wake_up|usleep|nanosleep|procyield|osyield`)
)

// kindOf is the kind of a sample in sym, a kernel function or not.
func kindOf(sym string, kernel bool) string {
	switch {
	case cryptoSym.MatchString(sym):
		return cpuKinds[0]
	case goCopySym.MatchString(sym):
		return cpuKinds[1]
	case kernel && kCopySym.MatchString(sym):
		return cpuKinds[2]
	case switchSym.MatchString(sym):
		return cpuKinds[3]
	case strings.HasPrefix(sym, "runtime.") || strings.HasPrefix(sym, "internal/runtime/"):
		return cpuKinds[4]
	case kernel:
		return cpuKinds[5]
	}
	return cpuKinds[6]
}

// perfLine is a line of perf script -F pid,ip,sym,dso: "PID IP SYM (DSO)".
var perfLine = regexp.MustCompile(`^\s*(\d+)\s+[0-9a-f]+\s+(.*?)\s+\(([^)]*)\)\s*$`)

// countKinds counts the samples of each pid in pids by kind.
func countKinds(r io.Reader, pids map[int]bool) (map[int]map[string]int, error) {
	counts := map[int]map[string]int{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		m := perfLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		pid, _ := strconv.Atoi(m[1])
		if !pids[pid] {
			continue
		}
		sym := strings.TrimSuffix(m[2], ".abi0")
		if counts[pid] == nil {
			counts[pid] = map[string]int{}
		}
		counts[pid][kindOf(sym, strings.Contains(m[3], "kernel"))]++
	}
	return counts, sc.Err()
}

// perfRun is perf recording some processes.
type perfRun struct {
	cmd  *exec.Cmd
	file string
	pids map[int]bool
}

// startPerf starts perf sampling procs' CPU, kernel and user.
func startPerf(dir string, procs []*proc) (*perfRun, error) {
	f, err := os.CreateTemp(dir, "perf-*.data")
	if err != nil {
		return nil, err
	}
	f.Close()
	pr := &perfRun{file: f.Name(), pids: map[int]bool{}}
	var list []string
	for _, p := range procs {
		pid := p.cmd.Process.Pid
		pr.pids[pid] = true
		list = append(list, strconv.Itoa(pid))
	}
	pr.cmd = exec.Command("perf", "record", "-q", "-e", "cpu-clock", "-F", "1999", "-o", pr.file, "-p", strings.Join(list, ","))
	if err := pr.cmd.Start(); err != nil {
		return nil, fmt.Errorf("perf record: %w", err)
	}
	return pr, nil
}

// stop ends the recording and returns each process's share of its samples
// by kind.
func (pr *perfRun) stop() (map[int]map[string]float64, error) {
	defer os.Remove(pr.file)
	pr.cmd.Process.Signal(syscall.SIGINT)
	if err := pr.cmd.Wait(); err != nil && !isSignalExit(err) {
		return nil, fmt.Errorf("perf record: %w", err)
	}
	out, err := exec.Command("perf", "script", "-i", pr.file, "-F", "pid,ip,sym,dso").Output()
	if err != nil {
		return nil, fmt.Errorf("perf script: %w", err)
	}
	counts, err := countKinds(strings.NewReader(string(out)), pr.pids)
	if err != nil {
		return nil, err
	}
	shares := map[int]map[string]float64{}
	for pid, c := range counts {
		total := 0
		for _, n := range c {
			total += n
		}
		shares[pid] = map[string]float64{}
		for k, n := range c {
			shares[pid][k] = float64(n) / float64(total)
		}
	}
	return shares, nil
}

func isSignalExit(err error) bool {
	ee, ok := err.(*exec.ExitError)
	return ok && !ee.Exited()
}

// kindRows returns what adds a row per kind: each of procs' CPU per GiB
// in that kind, from its share of the samples and cpu, its CPU per GiB.
func (b *bench) kindRows(label, name string, procs []*proc, cpu []float64, shares map[int]map[string]float64) func() {
	return func() {
		for _, k := range cpuKinds {
			var cells []string
			for i, p := range procs {
				cells = append(cells, fmt.Sprintf("%.2f", cpu[i]*shares[p.cmd.Process.Pid][k]))
			}
			b.add(row{name: fmt.Sprintf("%s CPU per GiB, %s: %s", label, name, k), tunnel: strings.Join(cells, " / ") + " s"})
		}
	}
}

// measureKinds runs measure while perf samples procs, if -cpukinds asks
// for it. It returns what adds the rows of each kind for the transfer name
// of gib GiB, labelled label (the processes, as "edge / agent").
func (b *bench) measureKinds(label, name string, gib float64, procs []*proc, measure func() error) (func(), error) {
	if !b.o.cpuKinds {
		return func() {}, measure()
	}
	pr, err := startPerf(b.dir, procs)
	if err != nil {
		return nil, err
	}
	cpu0 := make([]time.Duration, len(procs))
	for i, p := range procs {
		cpu0[i] = p.cpu()
	}
	merr := measure()
	cpu := make([]float64, len(procs))
	for i, p := range procs {
		cpu[i] = (p.cpu() - cpu0[i]).Seconds() / gib
	}
	shares, err := pr.stop()
	if merr != nil {
		return nil, merr
	}
	if err != nil {
		return nil, err
	}
	return b.kindRows(label, name, procs, cpu, shares), nil
}

// checkPerf says what -cpukinds needs when perf is missing.
func checkPerf() error {
	if _, err := exec.LookPath("perf"); err != nil {
		return fmt.Errorf("-cpukinds needs perf (Debian's linux-perf) on PATH: %w", err)
	}
	return nil
}
