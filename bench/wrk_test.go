package main

import (
	"errors"
	"testing"
	"time"
)

// wrk 4.1's report, as `wrk --latency` prints it.
const wrkReport = `Running 3s test @ http://127.0.0.1:18777/small
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     3.04ms    2.25ms  16.96ms   81.66%
    Req/Sec     1.40k   133.06     1.60k    80.00%
  Latency Distribution
     50%  312.00us
     75%    4.01ms
     90%    5.92ms
     99%    1.20ms
  12000 requests in 3.00s, 709.41KB read
  Socket errors: connect 1, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 4
Requests/sec:   4000.00
Transfer/sec:    709.25KB
`

// TestParseWrk: the good requests are the total less every error, with
// wrk's elapsed time and percentiles in their units.
func TestParseWrk(t *testing.T) {
	r, err := parseWrk([]byte(wrkReport))
	if err != nil {
		t.Fatal(err)
	}
	want := loadResult{n: 12000 - 10, errs: 10, elapsed: 3 * time.Second, p50: 312 * time.Microsecond, p99: 1200 * time.Microsecond}
	if r != want {
		t.Fatalf("got %+v, want %+v", r, want)
	}
}

// TestParseWrkRefuses a report without its counts or with a unit it does
// not know, rather than a rate of zero or a latency of nothing.
func TestParseWrkRefuses(t *testing.T) {
	for name, out := range map[string]string{
		"empty":        "",
		"connect":      "unable to connect to 127.0.0.1:1 Connection refused\n",
		"no p99":       "     50%  312.00us\n  10 requests in 1.00s, 1KB read\n",
		"bad unit":     "     50%  312.00ns\n     99%  1.00ms\n  10 requests in 1.00s, 1KB read\n",
		"bad count":    "     50%  312.00us\n     99%  1.00ms\n  ten requests in 1.00s, 1KB read\n",
		"zero elapsed": "     50%  312.00us\n     99%  1.00ms\n  10 requests in 0.00s, 1KB read\n",
	} {
		if _, err := parseWrk([]byte(out)); !errors.Is(err, errWrk) {
			t.Errorf("%s: err %v, want errWrk", name, err)
		}
	}
}

func TestWrkDuration(t *testing.T) {
	for s, want := range map[string]time.Duration{
		"312.00us": 312 * time.Microsecond, "1.20ms": 1200 * time.Microsecond,
		"3.00s": 3 * time.Second, "1.00m": time.Minute,
	} {
		if got, err := wrkDuration(s); err != nil || got != want {
			t.Errorf("%s: %v, %v; want %v", s, got, err, want)
		}
	}
}
