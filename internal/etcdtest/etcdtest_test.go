package etcdtest_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/ngstone/ngstone/internal/etcdtest"
)

func TestMain(m *testing.M) { etcdtest.Main(m) }

func TestPutGet(t *testing.T) {
	cli := etcdtest.Client(t)
	p := etcdtest.Prefix(t)
	ctx := context.Background()
	if _, err := cli.Put(ctx, p+"k", "v"); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, p+"k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("Get = %v, %v", resp, err)
	}
	if q := etcdtest.Prefix(t); q == p {
		t.Fatalf("two prefixes are equal: %s", q)
	}
}

// TestOneEtcdRelease: every go.etcd.io/etcd module in go.mod is on one
// release, as etcd's modules are only tested together.
func TestOneEtcdRelease(t *testing.T) {
	b, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	versions := map[string][]string{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && strings.HasPrefix(f[0], "go.etcd.io/etcd/") {
			versions[f[1]] = append(versions[f[1]], f[0])
		}
	}
	if len(versions) != 1 {
		t.Fatalf("etcd modules on several releases: %v", versions)
	}
}
