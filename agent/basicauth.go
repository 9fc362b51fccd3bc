package agent

import (
	"crypto/subtle"
	"encoding/base64"
	"errors"
)

// errFound stops a walk over header fields at the one sought.
var errFound = errors.New("found")

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

// allows reports whether the request head raw carries Basic credentials
// that match a pair: its first Authorization field is "Basic " and the
// base64 of USER:PASSWORD, read as net/http's Request.BasicAuth reads it
// (FuzzBasicAuth). Every pair is compared, in constant time.
func (b *basicAuth) allows(raw []byte) bool {
	_, rest, err := firstLine(raw)
	if err != nil {
		return false
	}
	var auth []byte
	eachHeader(rest, func(name, value []byte) error {
		if asciiEqualFold(name, "Authorization") {
			auth = value
			return errFound
		}
		return nil
	})
	const prefix = "Basic "
	if len(auth) < len(prefix) || !asciiEqualFold(auth[:len(prefix)], prefix) {
		return false
	}
	enc := auth[len(prefix):]
	cred := make([]byte, base64.StdEncoding.DecodedLen(len(enc)))
	n, err := base64.StdEncoding.Decode(cred, enc)
	if err != nil {
		return false
	}
	ok := 0
	for _, p := range b.pairs {
		ok |= subtle.ConstantTimeCompare(cred[:n], p)
	}
	return ok == 1
}
