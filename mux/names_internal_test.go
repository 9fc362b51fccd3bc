package mux

import "testing"

// TestEndsInNumber: WHATWG's "ends in a number", an empty last label
// skipped once.
func TestEndsInNumber(t *testing.T) {
	for h, want := range map[string]bool{
		"1.2.3": true, "1.2.3.": true, "a.0x": true, "a.0XfF": true, "a.09": true, "7": true,
		"a.b": false, "a.0xg": false, "a.b1": false, "1.2.3..": false, ".": false, "": false, "a.x0": false,
	} {
		if got := endsInNumber(h); got != want {
			t.Errorf("endsInNumber(%q) = %v, want %v", h, got, want)
		}
	}
}
