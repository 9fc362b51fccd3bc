package certs

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// Pebble reads its knobs from the environment when a VA or WFE is made:
	// no random sleep before validating, no deliberately rejected nonces.
	// Challenges are still really validated.
	os.Setenv("PEBBLE_VA_NOSLEEP", "1")
	os.Setenv("PEBBLE_WFE_NONCEREJECT", "0")
	goleak.VerifyTestMain(m,
		// pebble's VA runs one dispatcher per VA for the life of the
		// process; pebble has no way to stop it.
		goleak.IgnoreTopFunction("github.com/letsencrypt/pebble/v2/va.VAImpl.processTasks"),
		// certmagic keeps one ACME rate limiter per CA and account in a
		// package-level map, never stopped.
		goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.(*RingBufferRateLimiter).loop"),
		// certmagic refreshes a storage lock file every 5s until it sees
		// the file gone, so it outlives the unlock by up to 5s.
		goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.keepLockfileFresh"),
	)
}
