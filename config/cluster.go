package config

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
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
	fs.Duration("cluster-lease-ttl", 10*time.Second, "how long the bindings of an edge cut off from etcd outlive it (whole seconds)")
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
		LeaseTTL: e.dur(l, "cluster-lease-ttl"), Prefix: l.string("cluster-prefix"),
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
	case (cl.CertFile == "") != (cl.KeyFile == ""):
		return cl, errors.New("cluster-etcd-cert and cluster-etcd-key go together")
	}
	return cl, nil
}

// EtcdTLS returns the client TLS for etcd from the files of c; nil when
// none is set.
func (c Cluster) EtcdTLS() (*tls.Config, error) {
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
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("cluster-etcd-cert/key: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
