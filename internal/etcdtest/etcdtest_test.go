package etcdtest_test

import (
	"context"
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
