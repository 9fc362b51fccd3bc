package edge

// HealthGap is healthGap, for the tests of a member flipping its health.
const HealthGap = healthGap

// ClusterPending returns, in a cluster, the pool members' exchanges this
// edge counts in flight (forwarded, not yet ended) and the health writes
// it holds (shareHealth): both empty once every member is gone.
func ClusterPending(e *Edge) (inFlight, health int) {
	if e.cluster == nil {
		return 0, 0
	}
	e.cluster.mu.Lock()
	defer e.cluster.mu.Unlock()
	return len(e.cluster.inFlight), len(e.cluster.health)
}

// UsedNonces returns how many sign-in nonces e remembers as used.
func UsedNonces(e *Edge) int {
	e.oauth.mu.Lock()
	defer e.oauth.mu.Unlock()
	return len(e.oauth.used)
}
