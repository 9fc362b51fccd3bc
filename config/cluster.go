package config

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/registry"
)

// Cluster is an edge's cluster settings (`ngstone edge --cluster-etcd`).
// With no Endpoints the edge runs alone.
type Cluster struct {
	// Endpoints are the etcd client URLs.
	Endpoints []string
	// CAFile, CertFile and KeyFile are etcd's client TLS: the CA that
	// signed etcd's server certificate, and this edge's client certificate
	// and key when etcd requires one. Empty CAFile trusts the system's roots
	// for https endpoints.
	CAFile, CertFile, KeyFile string
	// Username and Password authenticate to etcd when it has auth enabled.
	Username, Password string
	// Node is this edge's unique name; Addr the listener for requests other
	// edges forward; Advertise where they reach it; Key the shared secret.
	Node, Addr, Advertise, Key string
	// LeaseTTL is how long a cut-off edge's bindings outlive it.
	LeaseTTL time.Duration
	// RouteStaleness is the longest the edge routes by a route cache etcd
	// has not confirmed current (2s, or a fifth of LeaseTTL if less, when
	// not set).
	RouteStaleness time.Duration
	// Prefix is the etcd key prefix.
	Prefix string
}

func clusterFlags(fs *pflag.FlagSet) {
	host, _ := os.Hostname()
	fs.StringSlice("cluster-etcd", nil, "etcd endpoints (comma-separated URLs): run as one of several edges sharing one registry; empty runs alone")
	fs.String("cluster-etcd-ca", "", "PEM file of the CA that signed etcd's server certificate")
	fs.String("cluster-etcd-cert", "", "client certificate PEM file for etcd (mutual TLS)")
	fs.String("cluster-etcd-key", "", "client private key PEM file for etcd (mutual TLS)")
	fs.String("cluster-etcd-username", "", "etcd user, when etcd has auth enabled")
	fs.String("cluster-etcd-password", "", "etcd password (NGSTONE_CLUSTER_ETCD_PASSWORD_FILE reads it from a file)")
	fs.String("cluster-prefix", registry.DefaultEtcdPrefix, "etcd key prefix of this cluster")
	fs.String("node-name", host, "this edge's name in the cluster, unique among its edges")
	fs.String("cluster-addr", ":7443", "listener for visitor requests forwarded by other edges (mutual TLS from --cluster-key)")
	fs.String("cluster-advertise", "", "address other edges reach --cluster-addr at (default: its bound address, with --node-name as host when it binds all interfaces)")
	fs.String("cluster-key", "", "secret shared by every edge of the cluster, at least 32 characters (NGSTONE_CLUSTER_KEY_FILE reads it from a file)")
	fs.Duration("cluster-lease-ttl", registry.DefaultLeaseTTL, "how long the bindings of an edge cut off from etcd outlive it (whole seconds); two thirds of it must outlast gRPC's keepalive (10s and its timeout), which a hung etcd member holds the lease's renewals for")
	fs.Duration("cluster-route-staleness", 0, "longest an edge routes by its route cache once etcd stops confirming it current (then it reads each name from etcd, or answers 503): the longest two edges may route one name differently (default 2s, or a fifth of --cluster-lease-ttl if less)")
}

// Cluster returns the cluster settings, after Load.
func (c *Edge) Cluster() (Cluster, error) {
	l := c.l
	var e errs
	cl := Cluster{
		Endpoints: l.strings("cluster-etcd"),
		CAFile:    l.string("cluster-etcd-ca"), CertFile: l.string("cluster-etcd-cert"), KeyFile: l.string("cluster-etcd-key"),
		Username: l.string("cluster-etcd-username"),
		Node:     l.string("node-name"), Addr: l.string("cluster-addr"), Advertise: l.string("cluster-advertise"),
		LeaseTTL: e.dur(l, "cluster-lease-ttl"), RouteStaleness: e.dur(l, "cluster-route-staleness"), Prefix: l.string("cluster-prefix"),
	}
	pw, err := l.secret("cluster-etcd-password")
	e.set(err)
	key, err := l.secret("cluster-key")
	e.set(err)
	cl.Password, cl.Key = pw, key
	if e.err != nil || len(cl.Endpoints) == 0 {
		return cl, e.err
	}
	switch {
	case cl.Node == "":
		return cl, errors.New("node-name is empty: give each edge of the cluster a unique name")
	case cl.Addr == "":
		return cl, errors.New("cluster-addr is empty: other edges forward visitor requests to it")
	case cl.LeaseTTL < time.Second:
		return cl, fmt.Errorf("cluster-lease-ttl %s: at least 1s", cl.LeaseTTL)
	case cl.RouteStaleness < 0 || cl.RouteStaleness > cl.LeaseTTL:
		return cl, fmt.Errorf("cluster-route-staleness %s: between 0 (the default) and --cluster-lease-ttl (%s)", cl.RouteStaleness, cl.LeaseTTL)
	case (cl.CertFile == "") != (cl.KeyFile == ""):
		return cl, errors.New("cluster-etcd-cert and cluster-etcd-key go together")
	}
	if cl.RouteStaleness == 0 {
		cl.RouteStaleness = min(cl.LeaseTTL/5, registry.DefaultRouteStaleness)
	}
	return cl, nil
}

// EtcdTLS returns the client TLS for etcd from the files of c; nil when
// none is set. The client certificate is read again when its files change,
// so that a rotated certificate serves the next connection to etcd without
// a restart; log hears of rotated files that do not load.
func (c Cluster) EtcdTLS(log *slog.Logger) (*tls.Config, error) {
	if c.CAFile == "" && c.CertFile == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return nil, fmt.Errorf("cluster-etcd-ca: %w", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("cluster-etcd-ca %s: no PEM certificate in it", c.CAFile)
		}
	}
	if c.CertFile != "" {
		kp := &keyPair{certFile: c.CertFile, keyFile: c.KeyFile, log: log}
		if _, err := kp.get(); err != nil {
			return nil, fmt.Errorf("cluster-etcd-cert/key: %w", err)
		}
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return kp.get() }
	}
	return tc, nil
}

// keyPair is a certificate and key read from files, and read again when
// either file's size or modification time changes. A pair that does not
// load (a rotation caught between its two writes) leaves the last good
// one in use, and is tried again at the next handshake.
type keyPair struct {
	certFile, keyFile string
	log               *slog.Logger

	mu     sync.Mutex
	stamp  [2]fileStamp // of the files cur was read from
	failed [2]fileStamp // of the files that last failed to load
	cur    *tls.Certificate
}

type fileStamp struct {
	size int64
	mod  time.Time
}

func (k *keyPair) get() (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	st, err := stamps(k.certFile, k.keyFile)
	if k.cur != nil && (err != nil || st == k.stamp) {
		return k.cur, nil
	}
	cert, err := tls.LoadX509KeyPair(k.certFile, k.keyFile)
	if err != nil && k.cur != nil {
		if st != k.failed && k.log != nil {
			k.log.Warn("cluster-etcd-cert/key changed but do not load; still using the previous client certificate", "err", err)
		}
		k.failed = st
		return k.cur, nil
	}
	if err != nil {
		return nil, err
	}
	k.cur, k.stamp = &cert, st
	return k.cur, nil
}

func stamps(files ...string) ([2]fileStamp, error) {
	var out [2]fileStamp
	for i, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			return out, err
		}
		out[i] = fileStamp{size: fi.Size(), mod: fi.ModTime()}
	}
	return out, nil
}
