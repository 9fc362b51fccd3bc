package edge

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// sealer encrypts and authenticates what the edge hands a browser to keep
// (the sign-in session, state and handoff), with AES-256-GCM. Each kind
// is sealed with its own additional data, so one is never read as another.
type sealer struct{ aead cipher.AEAD }

// sealKeyFile holds an edge's key, when it runs alone with a data dir.
const sealKeyFile = "oauth.key"

// newSealer makes a sealer on a 32-byte key.
func newSealer(key []byte) (*sealer, error) {
	if len(key) != 32 {
		return nil, fmt.Errorf("oauth key: want 32 bytes, have %d", len(key))
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &sealer{aead: aead}, nil
}

// sealKey is the key of an edge's cookies: derived from the cluster key,
// so that every edge of a cluster reads what another sealed; or kept in
// dataDir; or, with neither, made for this process only.
func sealKey(clusterKey, dataDir string) ([]byte, error) {
	if clusterKey != "" {
		return hkdf.Key(sha256.New, []byte(clusterKey), nil, "ngstone oauth cookies", 32)
	}
	if dataDir == "" {
		return randomKey()
	}
	path := filepath.Join(dataDir, sealKeyFile)
	if b, err := os.ReadFile(path); err == nil {
		if len(b) != 32 {
			return nil, fmt.Errorf("%s: want 32 bytes, have %d (remove it to make a new key)", path, len(b))
		}
		return b, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	key, err := randomKey()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, os.ErrExist) {
		return sealKey("", dataDir) // another process made it first
	} else if err != nil {
		return nil, err
	}
	if _, err := f.Write(key); err != nil {
		f.Close()
		return nil, err
	}
	return key, f.Close()
}

func randomKey() ([]byte, error) {
	key := make([]byte, 32)
	_, err := rand.Read(key)
	return key, err
}

// seal returns v as JSON, encrypted, base64url.
func (s *sealer) seal(kind string, v any) (string, error) {
	plain, err := json.Marshal(v)
	if err != nil {
		return "", err
	}
	nonce := make([]byte, s.aead.NonceSize(), s.aead.NonceSize()+len(plain)+s.aead.Overhead())
	if _, err := rand.Read(nonce); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(s.aead.Seal(nonce, nonce, plain, []byte(kind))), nil
}

// errUnsealed: a sealed value was forged, altered, of another kind, or
// sealed with another key.
var errUnsealed = errors.New("not sealed by this edge's key")

// open reads into v what seal made of kind.
func (s *sealer) open(kind, sealed string, v any) error {
	if len(sealed) > maxSealed {
		return errUnsealed
	}
	b, err := base64.RawURLEncoding.DecodeString(sealed)
	if err != nil || len(b) < s.aead.NonceSize() {
		return errUnsealed
	}
	n := s.aead.NonceSize()
	plain, err := s.aead.Open(nil, b[:n], b[n:], []byte(kind))
	if err != nil {
		return errUnsealed
	}
	return json.Unmarshal(plain, v)
}

// maxSealed bounds what open reads: a cookie is at most 4 KiB.
const maxSealed = 4 << 10
