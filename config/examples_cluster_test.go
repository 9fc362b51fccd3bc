package config_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestExampleClusterCompose checks the cluster example: three etcd
// members, two edges whose settings load as a valid cluster with distinct
// node names, and a load balancer that publishes the edges' ports and
// checks both.
func TestExampleClusterCompose(t *testing.T) {
	dir := filepath.Join(examplesDir, "cluster")
	b, err := os.ReadFile(filepath.Join(dir, "docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var c composeFile
	if err := yaml.Unmarshal(b, &c); err != nil {
		t.Fatalf("cluster/docker-compose.yml: %v", err)
	}
	var etcds []string
	for name := range c.Services {
		if strings.HasPrefix(name, "etcd") {
			etcds = append(etcds, name)
		}
	}
	if len(etcds) != 3 {
		t.Fatalf("etcd members %v, want 3", etcds)
	}
	haproxy, err := os.ReadFile(filepath.Join(dir, "haproxy.cfg"))
	if err != nil {
		t.Fatal(err)
	}
	nodes := map[string]bool{}
	for _, name := range []string{"edge-a", "edge-b"} {
		svc, ok := c.Services[name]
		if !ok {
			t.Fatalf("no service %s", name)
		}
		t.Run(name, func(t *testing.T) {
			clearNgstoneEnv(t)
			fs, l := exampleEdgeFlags(t, svc.Command...)
			provider := svc.Environment["NGSTONE_DNS_PROVIDER"]
			for k, v := range svc.Environment {
				if !exampleEnvKnown(fs, provider, k) {
					t.Errorf("environment %s is neither an edge flag's NGSTONE_* variable nor a setting of dns-provider %q", k, provider)
				}
				t.Setenv(k, composeVar.ReplaceAllString(v, strings.Repeat("x", 40)))
			}
			t.Setenv("NGSTONE_DOMAIN", "tunnels.example.com")
			t.Setenv("NGSTONE_DATA_DIR", "/data")
			if _, _, err := l.Load(); err != nil {
				t.Fatalf("load: %v", err)
			}
			cl, err := l.Cluster()
			if err != nil {
				t.Fatalf("cluster settings: %v", err)
			}
			if len(cl.Endpoints) != 3 || len(cl.Key) < 32 || cl.Addr != ":7443" {
				t.Fatalf("cluster settings %+v", cl)
			}
			for _, e := range etcds {
				if !slices.Contains(cl.Endpoints, "http://"+e+":2379") {
					t.Errorf("endpoints %v miss %s", cl.Endpoints, e)
				}
			}
			nodes[cl.Node] = true
			// The default advertised address is NODE:7443: the node name
			// must be the service name, which the other edge resolves.
			if cl.Node != name {
				t.Errorf("node-name %q is not the service name %q", cl.Node, name)
			}
			for _, port := range []string{"80", "443", "4443"} {
				if !strings.Contains(string(haproxy), "server "+name+" "+name+":"+port+" check") {
					t.Errorf("haproxy.cfg does not balance %s:%s", name, port)
				}
			}
		})
	}
	if len(nodes) != 2 {
		t.Errorf("node names %v are not distinct", nodes)
	}
	lb := c.Services["lb"]
	for _, p := range []string{"80:80", "443:443", "4443:4443"} {
		if !slices.Contains(lb.Ports, p) {
			t.Errorf("lb ports %v: missing %s", lb.Ports, p)
		}
	}
}
