package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/etcdtest"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// tcpForwarding is the line `ngstone tcp` prints once bound.
var tcpForwarding = regexp.MustCompile(`^Forwarding tcp://[^:/]+:(\d+) -> (\S+)$`)

// TestTCPRealClients runs the built binary's `ngstone tcp` and `ngstone
// tls` on the CLI's defaults between real programs: ssh to a loopback sshd
// running a command; redis-cli pipelining 10,000 commands into
// redis-server, whose answers come back in order; and openssl s_client,
// verifying the certificate of a local TLS service (not the edge's)
// through the edge's HTTPS port.
func TestTCPRealClients(t *testing.T) {
	sshd := "/usr/sbin/sshd" // off a user's PATH
	if _, err := os.Stat(sshd); err != nil {
		sshd = tunneltest.Tool(t, "sshd")
	}
	redis := tunneltest.Tool(t, "redis-server")
	ports := freePorts(t, 8)
	data := t.TempDir()
	startProc(t, nil, edgeArgs(data, ports[:3], "--tcp-ports", ports[3]+","+ports[4], "--https-addr", "127.0.0.1:"+ports[7])...)
	waitHealthy(t, "127.0.0.1:"+ports[2])
	agentArgs := []string{"--edge", "127.0.0.1:" + ports[1], "--server-name", "localhost", "--ca-file", filepath.Join(data, "ca.pem")}

	t.Run("ssh", func(t *testing.T) {
		key := startSSHD(t, sshd, ports[5])
		p := startProc(t, nil, append([]string{"tcp", ports[5]}, agentArgs...)...)
		public := p.waitLine(t, tcpForwarding)[1]
		out, err := exec.Command(tunneltest.Tool(t, "ssh"), "-p", public, "-i", key, "-o", "BatchMode=yes",
			"-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10",
			"root@127.0.0.1", "echo through-$((6*7))").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "through-42") {
			t.Fatalf("ssh through port %s: %v\n%s", public, err, out)
		}
	})
	t.Run("redis", func(t *testing.T) {
		startRedis(t, redis, ports[6])
		p := startProc(t, nil, append([]string{"tcp", ports[6]}, agentArgs...)...)
		public := p.waitLine(t, tcpForwarding)[1]
		cli := tunneltest.Tool(t, "redis-cli")
		var cmds strings.Builder
		for i := range 10000 {
			fmt.Fprintf(&cmds, "RPUSH order %d\r\n", i)
		}
		pipe := exec.Command(cli, "-p", public, "--pipe")
		pipe.Stdin = strings.NewReader(cmds.String())
		out, err := pipe.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "errors: 0, replies: 10000") {
			t.Fatalf("redis-cli --pipe through port %s: %v\n%s", public, err, out)
		}
		out, err = exec.Command(cli, "-p", public, "LRANGE", "order", "0", "-1").Output()
		got := strings.Fields(string(out))
		if err != nil || len(got) != 10000 {
			t.Fatalf("LRANGE through the tunnel: %d items, %v", len(got), err)
		}
		for i, v := range got {
			if v != strconv.Itoa(i) {
				t.Fatalf("item %d is %q: the answers are out of order", i, v)
			}
		}
	})
	t.Run("tls-openssl", func(t *testing.T) { tlsOpenSSL(t, ports[7], agentArgs) })
}

// tlsOpenSSL: openssl s_client verifies the local service's own
// certificate through `ngstone tls`, and talks to it.
func tlsOpenSSL(t *testing.T, https string, agentArgs []string) {
	const name = "secure.ngstone.test"
	openssl := tunneltest.Tool(t, "openssl")
	cert, _ := tunneltest.SelfSigned(t, name)
	caFile := filepath.Join(t.TempDir(), "local-ca.pem")
	write(t, caFile, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Leaf.Raw})))
	local := tunneltest.ServeConns(t, func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
		defer tc.Close() // with close_notify
		tc.SetDeadline(time.Now().Add(20 * time.Second))
		line, err := bufio.NewReader(tc).ReadString('\n')
		if err == nil {
			io.WriteString(tc, "echo: "+line)
		}
	})
	_, port, _ := net.SplitHostPort(local)
	p := startProc(t, nil, append([]string{"tls", port, "--subdomain", "secure"}, agentArgs...)...)
	p.waitLine(t, regexp.MustCompile(`^Forwarding tls://secure\.ngstone\.test:\d+ -> `))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, openssl, "s_client", "-connect", "127.0.0.1:"+https, "-servername", name,
		"-CAfile", caFile, "-verify_return_error", "-verify_hostname", name, "-quiet")
	cmd.Stdin = strings.NewReader("ping\n")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "echo: ping") {
		t.Fatalf("openssl s_client through ngstone tls: %v\n%s", err, out)
	}
}

// startSSHD runs sshd on loopback port, letting root in with a key of the
// test's own, and returns the key's file.
func startSSHD(t *testing.T, sshd, port string) string {
	t.Helper()
	dir := t.TempDir()
	keygen := tunneltest.Tool(t, "ssh-keygen")
	for _, k := range []string{"host", "user"} {
		if out, err := exec.Command(keygen, "-q", "-t", "ed25519", "-N", "", "-f", filepath.Join(dir, k)).CombinedOutput(); err != nil {
			t.Fatalf("ssh-keygen: %v\n%s", err, out)
		}
	}
	pub, err := os.ReadFile(filepath.Join(dir, "user.pub"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "authorized_keys"), string(pub))
	write(t, filepath.Join(dir, "sshd_config"), fmt.Sprintf(`ListenAddress 127.0.0.1:%s
HostKey %s/host
AuthorizedKeysFile %s/authorized_keys
PidFile none
StrictModes no
UsePAM no
PasswordAuthentication no
PermitRootLogin prohibit-password
`, port, dir, dir))
	os.MkdirAll("/run/sshd", 0o755) // its privilege separation directory
	cmd := exec.Command(sshd, "-D", "-e", "-f", filepath.Join(dir, "sshd_config"))
	runProc(t, cmd)
	waitListening(t, "127.0.0.1:"+port)
	return filepath.Join(dir, "user")
}

// startRedis runs redis-server on loopback port, with nothing on disk.
func startRedis(t *testing.T, redis, port string) {
	t.Helper()
	runProc(t, exec.Command(redis, "--bind", "127.0.0.1", "--port", port, "--save", "", "--appendonly", "no", "--dir", t.TempDir()))
	waitListening(t, "127.0.0.1:"+port)
}

func write(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

// waitListening waits until addr takes connections.
func waitListening(t *testing.T, addr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err == nil {
			c.Close()
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("nothing listens on %s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestTCPClusterProcesses: two `ngstone edge` processes on one etcd, on
// hosts of their own and the same --tcp-ports. redis-cli on edge b
// pipelines into the redis-server behind an `ngstone tcp` on edge a; the
// agent killed and started again on edge b prints the same port, which
// edge a then relays to it.
func TestTCPClusterProcesses(t *testing.T) {
	redis := tunneltest.Tool(t, "redis-server")
	cli := tunneltest.Tool(t, "redis-cli")
	endpoints := strings.Join(etcdtest.Endpoints(t), ",")
	prefix := etcdtest.Prefix(t)
	data := t.TempDir()
	ports := freePorts(t, 11)
	tcp, local := ports[9], ports[10]
	start := func(host string, p []string) {
		startProc(t, nil, edgeArgs(data, p, "--http-addr", host+":"+p[0], "--tcp-ports", tcp,
			"--cluster-etcd", endpoints, "--cluster-prefix", prefix, "--node-name", host,
			"--cluster-addr", "127.0.0.1:"+p[3], "--cluster-key", strings.Repeat("k", 40))...)
		waitHealthy(t, "127.0.0.1:"+p[2])
	}
	start("127.0.0.2", ports[0:4])
	start("127.0.0.3", ports[4:8])
	startRedis(t, redis, local)
	agentOn := func(control string) (*proc, string) {
		p := startProc(t, nil, "tcp", local, "--edge", "127.0.0.1:"+control, "--server-name", "localhost", "--ca-file", filepath.Join(data, "ca.pem"))
		return p, p.waitLine(t, tcpForwarding)[1]
	}
	ag, public := agentOn(ports[1])
	if public != tcp {
		t.Fatalf("the agent got port %s, want the edge's one port %s", public, tcp)
	}
	ping := func(host string) string {
		out, _ := exec.Command(cli, "-h", host, "-p", tcp, "PING").Output()
		return strings.TrimSpace(string(out))
	}
	waitFor(t, 5*time.Second, "edge b to route the port to edge a", func() bool { return ping("127.0.0.3") == "PONG" })
	var cmds strings.Builder
	for i := range 10000 {
		fmt.Fprintf(&cmds, "RPUSH order %d\r\n", i)
	}
	pipe := exec.Command(cli, "-h", "127.0.0.3", "-p", tcp, "--pipe")
	pipe.Stdin = strings.NewReader(cmds.String())
	if out, err := pipe.CombinedOutput(); err != nil || !strings.Contains(string(out), "errors: 0, replies: 10000") {
		t.Fatalf("redis-cli --pipe through edge b: %v\n%s", err, out)
	}

	ag.cmd.Process.Kill()
	_, public = agentOn(ports[5])
	if public != tcp {
		t.Fatalf("the agent started again on edge b got port %s, want %s", public, tcp)
	}
	waitFor(t, 5*time.Second, "edge a to route the port to edge b", func() bool { return ping("127.0.0.2") == "PONG" })
	out, err := exec.Command(cli, "-h", "127.0.0.2", "-p", tcp, "LLEN", "order").Output()
	if err != nil || strings.TrimSpace(string(out)) != "10000" {
		t.Fatalf("LLEN through edge a: %q, %v", out, err)
	}
}
