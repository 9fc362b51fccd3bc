package certs

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// files serves a certificate and key from disk. A changed pair is picked up
// by polling (or Reload on SIGHUP) and swapped atomically: handshakes in
// progress keep the old one, connections are never dropped.
type files struct {
	cfg  Config
	log  *slog.Logger
	cert atomic.Pointer[tls.Certificate]

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
					f.log.Warn("certificate files changed but did not load; keeping the old one", "err", err)
				}
			}
		}
	}
}

func (f *files) changed() bool {
	mt := latestModTime(f.cfg.CertFile, f.cfg.KeyFile)
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
	mt := latestModTime(f.cfg.CertFile, f.cfg.KeyFile)
	pair, err := tls.LoadX509KeyPair(f.cfg.CertFile, f.cfg.KeyFile)
	if err != nil {
		return fmt.Errorf("tls-cert %s / tls-key %s: %w", f.cfg.CertFile, f.cfg.KeyFile, err)
	}
	f.cert.Store(&pair)
	f.mu.Lock()
	f.modTime = mt
	f.mu.Unlock()
	f.log.Info("loaded certificate", "file", f.cfg.CertFile, "subject", pair.Leaf.Subject.CommonName, "not_after", pair.Leaf.NotAfter)
	return nil
}

func (f *files) getCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	if c := f.cert.Load(); c != nil {
		return c, nil
	}
	return nil, errNotStarted
}

func (f *files) notAfter() map[string]time.Time {
	return leafNotAfter(f.cert.Load())
}

func (f *files) close() error {
	if f.stop != nil {
		f.stop()
	}
	f.wg.Wait()
	return nil
}
