// Package wantest starts the emulated link of package wan for tests.
package wantest

import (
	"testing"

	"github.com/ngstone/ngstone/internal/wan"
)

// Start joins two network namespaces by an emulated link, closed (and its
// close checked) at the test's end, or skips the test where that cannot be
// done (no root, no TUN device).
func Start(t testing.TB) *wan.Pair {
	t.Helper()
	if err := wan.Usable(); err != nil {
		t.Skip(err)
	}
	p := &wan.Pair{}
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}
