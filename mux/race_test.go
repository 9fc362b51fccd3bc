//go:build race

package mux

// raceEnabled: the race detector makes sync.Pool drop a quarter of what
// is put, so a test cannot expect a buffer back.
const raceEnabled = true
