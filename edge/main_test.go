package edge_test

import (
	"testing"

	"github.com/ngstone/ngstone/internal/etcdtest"
)

// TestMain checks for leaked goroutines after stopping the embedded etcd
// the cluster tests share.
func TestMain(m *testing.M) { etcdtest.Main(m) }
