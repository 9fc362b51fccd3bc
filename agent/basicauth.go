package agent

import (
	"crypto/subtle"
	"net/http"
)

// minBasicAuthPassword is the shortest password --basic-auth takes.
const minBasicAuthPassword = 8

// basicAuth checks a request head for one of Config.BasicAuth's pairs.
type basicAuth struct {
	pairs [][]byte // USER:PASSWORD, as a visitor's Authorization encodes them
}

func newBasicAuth(pairs []string) *basicAuth {
	if len(pairs) == 0 {
		return nil
	}
	b := &basicAuth{}
	for _, p := range pairs {
		b.pairs = append(b.pairs, []byte(p))
	}
	return b
}

// allows reports whether r carries Basic credentials (as net/http's
// Request.BasicAuth reads them) that match a pair. Every pair is compared,
// in constant time.
func (b *basicAuth) allows(r *http.Request) bool {
	user, pass, ok := r.BasicAuth()
	if !ok {
		return false
	}
	cred := []byte(user + ":" + pass)
	match := 0
	for _, p := range b.pairs {
		match |= subtle.ConstantTimeCompare(cred, p)
	}
	return match == 1
}
