package certs

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// certmagic keeps one ACME rate limiter per CA and account in a
		// package-level map, never stopped.
		goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.(*RingBufferRateLimiter).loop"),
		// certmagic refreshes a storage lock file every 5s until it sees
		// the file gone, so it outlives the unlock by up to 5s.
		goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.keepLockfileFresh"),
	)
}
