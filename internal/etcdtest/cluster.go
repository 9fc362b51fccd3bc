package etcdtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// ClusterOptions shape a cluster of a test's own.
type ClusterOptions struct {
	// Members is the number of members; zero means 3.
	Members int
	// AuthToken is etcd's --auth-token (see JWTAuthToken); empty means
	// etcd's simple tokens.
	AuthToken string
}

// Cluster is etcd members of a test's own on loopback, each with its data
// in its own directory, for faults between them: tests put fault proxies
// in front of each member's client address, cut a member off from its
// peers (Cut, with etcd's own partition hook, as etcd's integration tests
// do) and kill members (Kill). Ticks are slower than the shared server's
// (50 ms, elections after 500 ms), so that three members on a loaded
// machine keep their leader unless a test takes it away.
type Cluster struct {
	tb      testing.TB
	Members []*Member
	dying   sync.WaitGroup
}

// Member is one member of a Cluster.
type Member struct {
	Name string
	// ClientAddr is the member's client listener, HOST:PORT.
	ClientAddr string
	etcd       *embed.Etcd

	mu   sync.Mutex
	dead bool
}

// StartCluster starts the members, waits until they have a leader, and
// stops them when tb ends.
func StartCluster(tb testing.TB, opts ClusterOptions) *Cluster {
	tb.Helper()
	n := opts.Members
	if n == 0 {
		n = 3
	}
	c := &Cluster{tb: tb}
	cfgs := make([]*embed.Config, n)
	var initial []string
	for i := range cfgs {
		cfg, err := memberConfig(fmt.Sprintf("m%d", i), filepath.Join(tb.TempDir(), "etcd"))
		if err != nil {
			tb.Fatalf("etcd member %d: %v", i, err)
		}
		cfg.TickMs, cfg.ElectionMs = 50, 500
		if opts.AuthToken != "" {
			cfg.AuthToken = opts.AuthToken
		}
		cfgs[i] = cfg
		initial = append(initial, cfg.Name+"="+cfg.AdvertisePeerUrls[0].String())
	}
	errs := make(chan error, n)
	for i, cfg := range cfgs {
		cfg.InitialCluster = strings.Join(initial, ",")
		m := &Member{Name: cfg.Name, ClientAddr: cfg.AdvertiseClientUrls[0].Host}
		c.Members = append(c.Members, m)
		go func() {
			e, err := embed.StartEtcd(cfgs[i])
			if err == nil {
				m.etcd = e
				err = ready(e)
			}
			errs <- err
		}()
	}
	// Every member's start is waited for, failed or not: one still
	// opening its data when the test ends and removes the directory
	// panics the whole test binary ("failed to open database").
	var failed error
	for range n {
		if err := <-errs; err != nil && failed == nil {
			failed = err
		}
	}
	tb.Cleanup(c.stop)
	if failed != nil {
		tb.Fatalf("etcd cluster: %v", failed)
	}
	c.Leader()
	return c
}

func (c *Cluster) stop() {
	for _, m := range c.Members {
		if m.alive() {
			m.etcd.Close()
			<-m.etcd.Server.StopNotify()
		}
	}
	c.dying.Wait()
}

func (m *Member) alive() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return !m.dead && m.etcd != nil
}

// ClientURL is the member's client URL.
func (m *Member) ClientURL() string { return "http://" + m.ClientAddr }

// Endpoints returns the client URLs of the live members.
func (c *Cluster) Endpoints() []string {
	var out []string
	for _, m := range c.Members {
		if m.alive() {
			out = append(out, m.ClientURL())
		}
	}
	return out
}

// Leader waits up to 10 s for a live member that leads, and returns its
// index.
func (c *Cluster) Leader() int {
	c.tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for i, m := range c.Members {
			if m.alive() && m.etcd.Server.Leader() == m.etcd.Server.MemberID() {
				return i
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.tb.Fatalf("etcd cluster: no leader within 10s")
	return -1
}

// Cut drops every raft message between member i and the others, both
// ways; its client port keeps answering what it can without them.
func (c *Cluster) Cut(i int) { c.peers(i, true) }

// Mend undoes Cut.
func (c *Cluster) Mend(i int) { c.peers(i, false) }

func (c *Cluster) peers(i int, cut bool) {
	a := c.Members[i].etcd.Server
	for j, m := range c.Members {
		if j == i || !m.alive() {
			continue
		}
		b := m.etcd.Server
		if cut {
			a.CutPeer(b.MemberID())
			b.CutPeer(a.MemberID())
		} else {
			a.MendPeer(b.MemberID())
			b.MendPeer(a.MemberID())
		}
	}
}

// StallApply stops member i from applying what raft commits, as a disk
// that stalls or a long defragmentation would: it holds the member's
// backend write lock. The member keeps voting, so the quorum stands, and
// keeps forwarding lease renewals to the leader, which answers them; its
// own reads, which wait for it to apply what was committed before them,
// and the writes sent to it, hang once anything is committed. The returned
// function (also run when tb ends) lets it go on.
func (c *Cluster) StallApply(i int) (resume func()) {
	tx := c.Members[i].etcd.Server.Backend().BatchTx()
	tx.Lock()
	var once sync.Once
	resume = func() { once.Do(tx.Unlock) }
	c.tb.Cleanup(resume) // before the members stop: they would wait for it
	return resume
}

// Kill takes member i away as a crash would: its raft messages are
// dropped at once, both ways (so it hands nothing on), and it stops in the
// background; a test puts its client port out of reach itself (closing
// its proxies). Stopping its raft alone would leave a member that answers
// every call with an error, and etcd goroutines that never end.
func (c *Cluster) Kill(i int) {
	c.Cut(i)
	m := c.Members[i]
	m.mu.Lock()
	m.dead = true
	m.mu.Unlock()
	c.dying.Add(1)
	go func() {
		defer c.dying.Done()
		m.etcd.Close()
	}()
}

// Client returns a client of the live members, as user (with password)
// when user is not empty, closed when tb ends.
func (c *Cluster) Client(tb testing.TB, user, password string) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: c.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		Username: user, Password: password,
	})
	if err != nil {
		tb.Fatalf("etcd client: %v", err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// JWTAuthToken returns an --auth-token that makes etcd sign JWT tokens
// with a key of the test's own.
func JWTAuthToken(tb testing.TB) string {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	priv, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		tb.Fatal(err)
	}
	pub, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		tb.Fatal(err)
	}
	dir := tb.TempDir()
	privFile, pubFile := filepath.Join(dir, "jwt.key"), filepath.Join(dir, "jwt.pub")
	for f, b := range map[string]*pem.Block{privFile: {Type: "EC PRIVATE KEY", Bytes: priv}, pubFile: {Type: "PUBLIC KEY", Bytes: pub}} {
		if err := os.WriteFile(f, pem.EncodeToMemory(b), 0o600); err != nil {
			tb.Fatal(err)
		}
	}
	return fmt.Sprintf("jwt,pub-key=%s,priv-key=%s,sign-method=ES256,ttl=10m", pubFile, privFile)
}
