package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// The bench's own visitors are Go clients in the bench process, on the same
// cores as the edge and the agent: as their number grows they take CPU from
// the path they measure. With -wrk the small-GET runs of plain HTTP are sent
// by wrk instead (an external C load generator on epoll, one thread by
// default), whose cost per request is a fraction of a Go client's. HTTPS
// runs stay on the Go visitors: wrk names the TLS server after the URL's
// host, and the edge chooses its certificate by that name.

// errWrk: wrk ran but its report could not be read.
var errWrk = errors.New("wrk report")

// wrkGETs runs wrk with conc connections against t's /small for d, after a
// warm-up of d/5 that a separate wrk run spends (its connections are new,
// as the Go visitors' warm-up connections are not: both are measured on
// connections already open at the start of the measured part).
func wrkGETs(bin string, threads int, t target, conc int, d time.Duration) (loadResult, error) {
	if _, err := runWrk(bin, threads, t, conc, max(d/5, time.Second)); err != nil {
		return loadResult{}, err
	}
	return runWrk(bin, threads, t, conc, d)
}

func runWrk(bin string, threads int, t target, conc int, d time.Duration) (loadResult, error) {
	threads = min(threads, conc)
	args := []string{"-t", strconv.Itoa(threads), "-c", strconv.Itoa(conc),
		"-d", strconv.Itoa(max(int(d.Seconds()), 1)) + "s", "--latency", "--timeout", "10s"}
	if t.host != "" {
		args = append(args, "-H", "Host: "+t.host)
	}
	args = append(args, t.base+"/small")
	ctx, cancel := context.WithTimeout(context.Background(), d+30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	out, err := cmd.Output()
	if err != nil {
		return loadResult{}, fmt.Errorf("wrk %s: %w", strings.Join(args, " "), err)
	}
	r, err := parseWrk(out)
	if err != nil {
		return loadResult{}, fmt.Errorf("wrk %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	r.genCPU = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	return r, nil
}

// parseWrk reads the report of `wrk --latency`: the requests and the time
// they took, the median and 99th percentile, and the errors (socket errors
// and responses that are not 2xx or 3xx). n counts good requests, as the Go
// visitors' figures do.
func parseWrk(out []byte) (loadResult, error) {
	var r loadResult
	var total int
	var seen struct{ total, p50, p99 bool }
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 5 && f[1] == "requests" && f[2] == "in":
			n, err1 := strconv.Atoi(f[0])
			el, err2 := wrkDuration(strings.TrimSuffix(f[3], ","))
			if err1 != nil || err2 != nil {
				return r, fmt.Errorf("%w: %q", errWrk, sc.Text())
			}
			total, r.elapsed, seen.total = n, el, true
		case len(f) == 2 && (f[0] == "50%" || f[0] == "99%"):
			v, err := wrkDuration(f[1])
			if err != nil {
				return r, fmt.Errorf("%w: %q", errWrk, sc.Text())
			}
			if f[0] == "50%" {
				r.p50, seen.p50 = v, true
			} else {
				r.p99, seen.p99 = v, true
			}
		case len(f) >= 2 && f[0] == "Socket" && f[1] == "errors:":
			for i := 2; i+1 < len(f); i += 2 {
				n, err := strconv.Atoi(strings.TrimSuffix(f[i+1], ","))
				if err != nil {
					return r, fmt.Errorf("%w: %q", errWrk, sc.Text())
				}
				r.errs += n
			}
		case len(f) == 5 && f[0] == "Non-2xx":
			n, err := strconv.Atoi(f[4])
			if err != nil {
				return r, fmt.Errorf("%w: %q", errWrk, sc.Text())
			}
			r.errs += n
		}
	}
	if !seen.total || !seen.p50 || !seen.p99 || r.elapsed <= 0 {
		return r, fmt.Errorf("%w: no request count, elapsed time, p50 or p99", errWrk)
	}
	r.n = max(total-r.errs, 0)
	return r, nil
}

// wrkDuration reads wrk's durations: 312.00us, 1.20ms, 3.00s, 1.00m.
func wrkDuration(s string) (time.Duration, error) {
	units := []struct {
		suffix string
		unit   time.Duration
	}{{"us", time.Microsecond}, {"ms", time.Millisecond}, {"m", time.Minute}, {"s", time.Second}}
	for _, u := range units {
		if v, ok := strings.CutSuffix(s, u.suffix); ok {
			x, err := strconv.ParseFloat(v, 64)
			if err != nil || x < 0 {
				return 0, fmt.Errorf("%w: duration %q", errWrk, s)
			}
			return time.Duration(x * float64(u.unit)), nil
		}
	}
	return 0, fmt.Errorf("%w: duration %q", errWrk, s)
}
