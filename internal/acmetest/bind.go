package acmetest

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// BIND is a named (BIND 9) process authoritative for one zone on a
// loopback port, taking RFC 2136 updates of TXT records signed with its
// TSIG key: the DNS server an operator would run, for the tests that
// need a real one. Stop and Start take it down and bring it back on the
// same port, with the zone as it was.
type BIND struct {
	// Addr is the server's HOST:PORT (UDP and TCP).
	Addr string
	// Zone is the zone, lower case, without trailing dot.
	Zone string
	// KeyName and Secret are the TSIG key (hmac-sha256) updates need.
	KeyName, Secret string

	t    testing.TB
	bin  string
	dir  string
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	out  *bytes.Buffer
}

// StartBIND runs named for zone until the end of the test. It skips the
// test when named is not installed (Debian: apt-get install bind9; .ci/run
// installs it).
func StartBIND(t testing.TB, zone string) *BIND {
	t.Helper()
	bin, err := exec.LookPath("named")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/named"); serr != nil {
			t.Skip("named (BIND 9) is not installed: apt-get install bind9 to run this test against a real RFC 2136 server")
		}
		bin = "/usr/sbin/named"
	}
	secret := make([]byte, 32)
	rand.Read(secret)
	b := &BIND{t: t, bin: bin, dir: t.TempDir(), Zone: strings.ToLower(strings.TrimSuffix(zone, ".")),
		KeyName: "ngstone-acme.", Secret: base64.StdEncoding.EncodeToString(secret)}
	t.Cleanup(b.Stop)
	for range 5 { // a port probed free may be taken before named binds it
		pc, ln := listenUDPTCP(t)
		b.Addr = pc.LocalAddr().String()
		pc.Close()
		ln.Close()
		b.writeConfig()
		if err := b.start(); err == nil {
			return b
		} else {
			t.Logf("named on %s: %v", b.Addr, err)
		}
	}
	t.Fatal("named did not start")
	return nil
}

// RFC2136Credentials are the certs.Config.DNSCredentials with which the
// rfc2136 provider updates b.
func (b *BIND) RFC2136Credentials() map[string]string {
	return map[string]string{"server": b.Addr, "tsig_key": b.KeyName, "tsig_secret": b.Secret, "tsig_algorithm": "hmac-sha256"}
}

// SetSecret gives the server's key a new secret, as an operator rotating
// it does: the server restarts with the zone as it was.
func (b *BIND) SetSecret(secret string) {
	b.t.Helper()
	b.Stop()
	b.Secret = secret
	b.writeFiles(false)
	b.Start()
}

func (b *BIND) writeConfig() { b.writeFiles(true) }

// writeFiles writes named.conf and, if zone, a fresh zone file.
func (b *BIND) writeFiles(zone bool) {
	_, port, _ := strings.Cut(b.Addr, ":")
	conf := fmt.Sprintf(`options {
	directory %[1]q;
	pid-file none;
	session-keyfile none;
	listen-on port %[2]s { 127.0.0.1; };
	listen-on-v6 { none; };
	recursion no;
	dnssec-validation no;
	notify no;
};
controls { };
logging { category default { default_stderr; }; };
key %[3]q { algorithm hmac-sha256; secret %[4]q; };
zone %[5]q { type primary; file "zone.db"; update-policy { grant %[3]s zonesub TXT; }; };
`, b.dir, port, b.KeyName, b.Secret, b.Zone)
	z := b.Zone + "."
	db := fmt.Sprintf("$TTL 1\n@ IN SOA ns.%[1]s hostmaster.%[1]s 1 60 60 600 1\n@ IN NS ns.%[1]s\n@ IN A 127.0.0.1\n* IN A 127.0.0.1\n", z)
	files := map[string]string{"named.conf": conf}
	if zone {
		files["zone.db"] = db
		// A journal of an earlier run would not match a new zone file.
		os.Remove(filepath.Join(b.dir, "zone.db.jnl"))
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(b.dir, name), []byte(data), 0o644); err != nil {
			b.t.Fatal(err)
		}
	}
}

// Start brings a stopped server back on the same port.
func (b *BIND) Start() {
	b.t.Helper()
	if err := b.start(); err != nil {
		b.t.Fatalf("restart named on %s: %v", b.Addr, err)
	}
}

func (b *BIND) start() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd != nil {
		return nil
	}
	out := &bytes.Buffer{}
	cmd := exec.Command(b.bin, "-g", "-n", "1", "-c", filepath.Join(b.dir, "named.conf"))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	deadline := time.Now().Add(20 * time.Second)
	for !b.answers() {
		select {
		case <-done:
			return fmt.Errorf("named exited: %s", out)
		default:
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			<-done
			return fmt.Errorf("named did not answer within 20s: %s", out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	b.cmd, b.done, b.out = cmd, done, out
	return nil
}

func (b *BIND) answers() bool {
	m := new(dns.Msg)
	m.SetQuestion(b.Zone+".", dns.TypeSOA)
	in, _, err := (&dns.Client{Net: "tcp", Timeout: time.Second}).Exchange(m, b.Addr)
	return err == nil && in.Rcode == dns.RcodeSuccess && len(in.Answer) > 0
}

// Stop ends the server (it is down until Start).
func (b *BIND) Stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd == nil {
		return
	}
	b.cmd.Process.Kill()
	<-b.done
	if b.t.Failed() {
		b.t.Logf("named on %s:\n%s", b.Addr, b.out)
	}
	b.cmd = nil
}

// TXT returns the TXT values at name, as the server answers now.
func (b *BIND) TXT(name string) ([]string, error) {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), dns.TypeTXT)
	in, _, err := (&dns.Client{Net: "tcp", Timeout: 2 * time.Second}).Exchange(m, b.Addr)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, rr := range in.Answer {
		if t, ok := rr.(*dns.TXT); ok {
			out = append(out, strings.Join(t.Txt, ""))
		}
	}
	return out, nil
}
