package certs

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// files serves certificates and keys from disk, one pair or several. A
// changed file is picked up by polling (or Reload on SIGHUP) and every
// pair is loaded again and swapped in at once: handshakes in progress keep
// the old ones, connections are never dropped, and a pair that does not
// load keeps all the old ones.
type files struct {
	cfg   Config
	log   *slog.Logger
	pairs atomic.Pointer[[]tls.Certificate]

	mu      sync.Mutex
	modTime time.Time
	stop    context.CancelFunc
	wg      sync.WaitGroup
}

func (f *files) start(ctx context.Context) error {
	if err := f.reload(); err != nil {
		return err
	}
	interval := f.cfg.ReloadInterval
	if interval == 0 {
		interval = 10 * time.Second
	}
	if interval < 0 {
		return nil
	}
	ctx, f.stop = context.WithCancel(context.WithoutCancel(ctx))
	f.wg.Add(1)
	go f.poll(ctx, interval)
	return nil
}

func (f *files) poll(ctx context.Context, interval time.Duration) {
	defer f.wg.Done()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if f.changed() {
				if err := f.reload(); err != nil {
					f.log.Warn("certificate files changed but did not load; keeping the old ones", "err", err)
				}
			}
		}
	}
}

func (f *files) paths() []string {
	return append(append([]string(nil), f.cfg.CertFiles...), f.cfg.KeyFiles...)
}

func (f *files) changed() bool {
	mt := latestModTime(f.paths()...)
	f.mu.Lock()
	defer f.mu.Unlock()
	return !mt.Equal(f.modTime)
}

func latestModTime(paths ...string) time.Time {
	var latest time.Time
	for _, p := range paths {
		if st, err := os.Stat(p); err == nil && st.ModTime().After(latest) {
			latest = st.ModTime()
		}
	}
	return latest
}

func (f *files) reload() error {
	mt := latestModTime(f.paths()...)
	pairs := make([]tls.Certificate, len(f.cfg.CertFiles))
	for i, cert := range f.cfg.CertFiles {
		pair, err := tls.LoadX509KeyPair(cert, f.cfg.KeyFiles[i])
		if err != nil {
			return fmt.Errorf("tls-cert %s / tls-key %s: %w", cert, f.cfg.KeyFiles[i], err)
		}
		pairs[i] = pair
	}
	f.pairs.Store(&pairs)
	f.mu.Lock()
	f.modTime = mt
	f.mu.Unlock()
	for i, pair := range pairs {
		f.log.Info("loaded certificate", "file", f.cfg.CertFiles[i], "names", pair.Leaf.DNSNames, "not_after", pair.Leaf.NotAfter)
	}
	return nil
}

// getCertificate picks the first pair whose certificate the client can
// use for its server name, else the first pair (which the client will
// refuse for a name it does not cover, as it should).
func (f *files) getCertificate(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	p := f.pairs.Load()
	if p == nil {
		return nil, errNotStarted
	}
	pairs := *p
	if len(pairs) > 1 {
		for i := range pairs {
			if hello.SupportsCertificate(&pairs[i]) == nil {
				return &pairs[i], nil
			}
		}
	}
	return &pairs[0], nil
}

func (f *files) notAfter() map[string]time.Time {
	out := map[string]time.Time{}
	if p := f.pairs.Load(); p != nil {
		for i := range *p {
			maps.Copy(out, leafNotAfter(&(*p)[i]))
		}
	}
	return out
}

func (f *files) close() error {
	if f.stop != nil {
		f.stop()
	}
	f.wg.Wait()
	return nil
}
