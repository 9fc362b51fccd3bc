package agent_test

import (
	"testing"

	"github.com/ngstone/ngstone/internal/etcdtest"
)

// TestMain checks for leaked goroutines after stopping the embedded etcd
// the ownership tests run on.
func TestMain(m *testing.M) { etcdtest.Main(m) }
