package main

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// smallBody is what GET /small returns.
var smallBody = []byte("hello from the bench backend\n")

// backend is the local service: plain HTTP (the agent's upstream and the
// direct baseline) and HTTPS (the direct baseline of the HTTPS rows).
type backend struct {
	plain, tls *httptest.Server
}

func newBackend() *backend {
	h := backendHandler()
	b := &backend{plain: httptest.NewUnstartedServer(h), tls: httptest.NewUnstartedServer(h)}
	b.plain.Start()
	b.tls.StartTLS()
	return b
}

// backendHandler serves /small, /blob?n=N (N bytes) and /sink (counts
// what is posted).
func backendHandler() http.Handler {
	h := http.NewServeMux()
	h.HandleFunc("GET /small", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		if r.URL.Query().Has("at") {
			// When the request arrived, for the WAN bench's two legs.
			w.Header().Set("Bench-At", strconv.FormatInt(time.Now().UnixNano(), 10))
		}
		w.Write(smallBody)
	})
	h.HandleFunc("GET /blob", func(w http.ResponseWriter, r *http.Request) {
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		buf := make([]byte, 256<<10)
		for n > 0 {
			k, err := w.Write(buf[:min(n, int64(len(buf)))])
			if err != nil {
				return
			}
			n -= int64(k)
		}
	})
	h.HandleFunc("POST /sink", func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, 256<<10)
		n, _ := io.CopyBuffer(io.Discard, r.Body, buf)
		io.WriteString(w, strconv.FormatInt(n, 10))
	})
	return h
}

func (b *backend) close() {
	b.plain.Close()
	b.tls.Close()
}

// target is one way to reach the backend: directly or through the tunnel,
// over HTTP or HTTPS.
type target struct {
	base string // scheme://127.0.0.1:PORT
	host string // the Host header (and TLS server name)
	tls  *tls.Config
	// dial, when set, makes the visitor's connections (in a network
	// namespace of the WAN bench).
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (t target) client(conns int) *http.Client {
	dial := t.dial
	if dial == nil {
		dial = (&net.Dialer{Timeout: 5 * time.Second}).DialContext
	}
	tr := &http.Transport{
		DialContext:         dial,
		TLSClientConfig:     t.tls,
		MaxIdleConns:        conns,
		MaxIdleConnsPerHost: conns,
		MaxConnsPerHost:     conns,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
		WriteBufferSize:     64 << 10,
		ReadBufferSize:      64 << 10,
	}
	return &http.Client{Transport: tr, Timeout: 60 * time.Second}
}

func (t target) request(ctx context.Context, method, path string, body io.Reader, n int64) *http.Request {
	req, err := http.NewRequestWithContext(ctx, method, t.base+path, body)
	if err != nil {
		panic(err)
	}
	if t.host != "" {
		req.Host = t.host
	}
	if body != nil {
		req.ContentLength = n
	}
	return req
}

// get sends one GET and reports its status (0 on a transport error).
func (t target) get(ctx context.Context, c *http.Client, path string) int {
	resp, err := c.Do(t.request(ctx, http.MethodGet, path, nil, 0))
	if err != nil {
		return 0
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// loadResult is one run of small GETs.
type loadResult struct {
	n, errs  int
	elapsed  time.Duration
	p50, p99 time.Duration
	// genCPU is the load generator's CPU over the run: wrk's, or the
	// bench process's (its visitors and the backend).
	genCPU time.Duration
}

func (r loadResult) rps() float64 { return float64(r.n) / r.elapsed.Seconds() }

// smallGETs runs conc keep-alive visitors sending GET /small for d, after a
// warm-up that opens their connections.
func smallGETs(t target, conc int, d time.Duration) loadResult {
	c := t.client(conc)
	defer c.CloseIdleConnections()
	run(t, c, conc, d/5)
	return run(t, c, conc, d)
}

func run(t target, c *http.Client, conc int, d time.Duration) loadResult {
	ctx := context.Background()
	return measure(conc, d, func() bool { return t.get(ctx, c, "/small") == http.StatusOK })
}

// measure runs conc callers of call for d and returns the successful
// calls' count and latencies, and the bench's own CPU meanwhile.
func measure(conc int, d time.Duration, call func() bool) loadResult {
	cpu0 := selfCPU()
	lats := make([][]time.Duration, conc)
	errs := make([]int, conc)
	start := time.Now()
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for i := range conc {
		wg.Go(func() {
			l := make([]time.Duration, 0, 4096)
			for time.Now().Before(deadline) {
				t0 := time.Now()
				if !call() {
					errs[i]++
					continue
				}
				l = append(l, time.Since(t0))
			}
			lats[i] = l
		})
	}
	wg.Wait()
	r := loadResult{elapsed: time.Since(start), genCPU: selfCPU() - cpu0}
	all := slices.Concat(lats...)
	slices.Sort(all)
	r.n = len(all)
	for _, e := range errs {
		r.errs += e
	}
	if len(all) > 0 {
		r.p50 = all[len(all)/2]
		r.p99 = all[len(all)*99/100]
	}
	return r
}

// selfCPU is the bench process's CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// zeros is an endless reader of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// download fetches n bytes and returns the throughput in bytes per second.
func download(t target, c *http.Client, n int64) (float64, error) {
	start := time.Now()
	resp, err := c.Do(t.request(context.Background(), http.MethodGet, "/blob?n="+strconv.FormatInt(n, 10), nil, 0))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	got, err := io.CopyBuffer(io.Discard, resp.Body, make([]byte, 256<<10))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK || got != n {
		return 0, errors.New("download: status " + resp.Status + ", " + strconv.FormatInt(got, 10) + " bytes")
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// upload posts n bytes and returns the throughput in bytes per second.
func upload(t target, c *http.Client, n int64) (float64, error) {
	start := time.Now()
	resp, err := c.Do(t.request(context.Background(), http.MethodPost, "/sink", io.LimitReader(zeros{}, n), n))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(b) != strconv.FormatInt(n, 10) {
		return 0, errors.New("upload: status " + resp.Status + ", " + string(b))
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// median runs f k times and returns the median of its results.
func median(k int, f func() (float64, error)) (float64, error) {
	var xs []float64
	for range k {
		x, err := f()
		if err != nil {
			return 0, err
		}
		xs = append(xs, x)
	}
	slices.Sort(xs)
	return xs[len(xs)/2], nil
}

// waitOK polls path until it answers 200 or timeout passes, and returns
// when it did.
func waitOK(t target, c *http.Client, timeout, every time.Duration) (time.Time, bool) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st := t.get(ctx, c, "/small")
		cancel()
		if st == http.StatusOK {
			return time.Now(), true
		}
		time.Sleep(every)
	}
	return time.Time{}, false
}

// resetProxy forwards TCP connections to an address; reset closes every
// connection it carries, as a network reset would.
type resetProxy struct {
	ln    net.Listener
	to    string
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func newResetProxy(to string) (*resetProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &resetProxy{ln: ln, to: to, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	return p, nil
}

func (p *resetProxy) addr() string { return p.ln.Addr().String() }

func (p *resetProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.DialTimeout("tcp", p.to, 5*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[u] = struct{}{}, struct{}{}
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(c, u) })
		p.wg.Go(func() { p.pipe(u, c) })
	}
}

func (p *resetProxy) pipe(dst, src net.Conn) {
	io.Copy(dst, src)
	dst.Close()
	src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
}

// reset closes both sides of every carried connection (with RST).
func (p *resetProxy) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
	}
}

func (p *resetProxy) close() {
	p.ln.Close()
	p.reset()
	p.wg.Wait()
}
