package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"

	"github.com/ngstone/ngstone/internal/acmetest"
)

// These tests run `ngstone edge` processes against pebble and a DNS
// server in the test process.

const acmeDomain = "ngstone.test"

// acmeEdgeArgs is an edge for acmeDomain on the given loopback ports
// (http, https, control, admin) whose certificates come from ca.
func acmeEdgeArgs(data string, ports []string, ca *acmetest.CA, extra ...string) []string {
	return append([]string{"edge", "--domain", acmeDomain, "--data-dir", data,
		"--http-addr", "127.0.0.1:" + ports[0], "--https-addr", "127.0.0.1:" + ports[1],
		"--control-addr", "127.0.0.1:" + ports[2], "--admin-addr", "127.0.0.1:" + ports[3],
		"--acme-ca", ca.DirectoryURL, "--acme-ca-root", ca.RootFile, "--log-format", "json"}, extra...)
}

// rfc2136Env is the environment that points the rfc2136 provider at d.
func rfc2136Env(d *acmetest.DNS) []string {
	c := d.RFC2136Credentials()
	return []string{"RFC2136_NAMESERVER=" + c["server"], "RFC2136_TSIG_KEY=" + c["tsig_key"], "RFC2136_TSIG_SECRET=" + c["tsig_secret"]}
}

// TestNoEmailOnATerminal: an edge without --acme-email whose standard
// input and output are a terminal (docker run -it, a shell) never prompts
// for an address: it starts, obtains its certificates without a contact
// and turns healthy. certmagic would block on "Email address:".
func TestNoEmailOnATerminal(t *testing.T) {
	t.Parallel()
	d := acmetest.StartDNS(t, acmeDomain)
	ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr})
	ports := freePorts(t, 4)
	cmd := exec.Command(ngstoneBin, acmeEdgeArgs(t.TempDir(), ports, ca, "--tls-mode", "certmagic", "--dns-provider", "rfc2136",
		"--dns-resolvers", d.Addr)...)
	cmd.Env = append(os.Environ(), rfc2136Env(d)...)
	tty, err := pty.Start(cmd)
	if err != nil {
		t.Fatalf("start on a pseudo-terminal: %v", err)
	}
	var mu sync.Mutex
	var out bytes.Buffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			n, err := tty.Read(buf)
			mu.Lock()
			out.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		tty.Close()
		<-done
	})
	admin := "127.0.0.1:" + ports[3]
	deadline := time.Now().Add(60 * time.Second)
	for healthcheck(t.Context(), admin, time.Second) != nil {
		mu.Lock()
		text := out.String()
		mu.Unlock()
		if strings.Contains(text, "Email address") {
			t.Fatalf("the edge prompted on the terminal:\n%s", text)
		}
		if time.Now().After(deadline) {
			t.Fatalf("edge without --acme-email on a terminal not healthy within 60s; terminal:\n%s", text)
		}
		time.Sleep(50 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if strings.Contains(out.String(), "Email address") {
		t.Fatalf("the edge prompted on the terminal:\n%s", out.String())
	}
}

// TestChallengesOnOwnListeners: in the modes that answer HTTP-01 and
// TLS-ALPN-01 (certmagic on-demand without a DNS provider, autocert), the
// edge process listens on its four configured addresses and nothing
// else, before, during and after an issuance (certmagic's solvers would
// otherwise open *:80 or *:443 themselves). The listening sockets are
// read from /proc, as ss -ltnp does.
func TestChallengesOnOwnListeners(t *testing.T) {
	for _, mode := range [][]string{{"--tls-mode", "certmagic", "--on-demand"}, {"--tls-mode", "autocert"}} {
		t.Run(mode[1], func(t *testing.T) {
			t.Parallel()
			ports := freePorts(t, 4)
			httpPort, _ := strconv.Atoi(ports[0])
			tlsPort, _ := strconv.Atoi(ports[1])
			d := acmetest.StartDNS(t, acmeDomain)
			ca := acmetest.StartCA(t, acmetest.CAConfig{DNS: d.Addr, HTTPPort: httpPort, TLSPort: tlsPort})
			e := startProc(t, nil, acmeEdgeArgs(t.TempDir(), ports, ca, append(mode, "--acme-email", "ops@"+acmeDomain)...)...)
			waitHealthy(t, "127.0.0.1:"+ports[3])

			seen := map[string]bool{}
			var mu sync.Mutex
			stop := make(chan struct{})
			polled := make(chan struct{})
			go func() {
				defer close(polled)
				for {
					socks, err := listeningSockets(e.cmd.Process.Pid)
					mu.Lock()
					for _, s := range socks {
						seen[s] = true
					}
					mu.Unlock()
					select {
					case <-stop:
						return
					case <-time.After(5 * time.Millisecond):
					}
					if err != nil {
						return
					}
				}
			}()
			handshakeUntilServed(t, "127.0.0.1:"+ports[1], ca, acmeDomain)
			close(stop)
			<-polled

			var want []string
			for _, p := range ports {
				want = append(want, "127.0.0.1:"+p)
			}
			var got []string
			for s := range seen {
				got = append(got, s)
			}
			slices.Sort(want)
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Errorf("the edge listened on %v, want only its configured %v", got, want)
			}
		})
	}
}

// handshakeUntilServed handshakes for host until a certificate from ca is
// served (the first ones start the issuance).
func handshakeUntilServed(t *testing.T, addr string, ca *acmetest.CA, host string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{RootCAs: ca.Roots, ServerName: host})
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no certificate for %s within 60s: %v", host, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// listeningSockets returns the TCP addresses pid listens on: its socket
// inodes (/proc/PID/fd) matched with the LISTEN entries of its network
// namespace's /proc/PID/net/tcp and tcp6.
func listeningSockets(pid int) ([]string, error) {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return nil, err
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join(fmt.Sprintf("/proc/%d/fd", pid), fd.Name()))
		if inode, ok := strings.CutPrefix(link, "socket:["); ok && err == nil {
			inodes[strings.TrimSuffix(inode, "]")] = true
		}
	}
	var out []string
	for _, table := range []string{"tcp", "tcp6"} {
		f, err := os.Open(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) < 10 || fields[3] != "0A" || !inodes[fields[9]] {
				continue
			}
			out = append(out, procAddr(fields[1]))
		}
		f.Close()
	}
	return out, nil
}

// procAddr decodes /proc/net/tcp's "0100007F:1F90" (IPv4 or IPv6, in
// host byte order per 32-bit word) as "127.0.0.1:8080".
func procAddr(s string) string {
	hexIP, hexPort, _ := strings.Cut(s, ":")
	port, _ := strconv.ParseUint(hexPort, 16, 16)
	ip := make(net.IP, len(hexIP)/2)
	for i := 0; i+8 <= len(hexIP); i += 8 {
		w, _ := strconv.ParseUint(hexIP[i:i+8], 16, 32)
		ip[i/2], ip[i/2+1], ip[i/2+2], ip[i/2+3] = byte(w), byte(w>>8), byte(w>>16), byte(w>>24)
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(int(port)))
}
