package certs

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"time"
)

// RetryFile is the file under the data directory where failed attempts to
// obtain or renew a certificate are kept, so that a restarted edge (a
// supervisor's restart loop included) waits out the backoff instead of
// placing a new order at once.
const RetryFile = "acme-retry.json"

// Defaults of the retry schedule: the wait after the n-th consecutive
// failure is RetryBase·2^(n-1), capped at RetryMax.
const (
	defaultRetryBase = time.Minute
	defaultRetryMax  = time.Hour
)

// maxRetryEntries bounds the names the retry book remembers (on-demand
// and autocert names are not known in advance); the oldest go first.
const maxRetryEntries = 256

// retryEntry is the book's record of one name's consecutive failures.
type retryEntry struct {
	// Failures counts the attempts since the last success, the one in
	// flight included: an attempt counts as failed until it succeeds, so
	// a process killed in the middle of one still waits when restarted.
	Failures    int       `json:"failures"`
	LastAttempt time.Time `json:"last_attempt"`
	NextAttempt time.Time `json:"next_attempt"`
	Kind        string    `json:"kind,omitempty"`
	Reason      string    `json:"reason,omitempty"`
	Error       string    `json:"error,omitempty"`
	// Settings is a digest of the settings the attempts used: after an
	// operator changed them, the next attempt is not held back.
	Settings string `json:"settings,omitempty"`

	inFlight bool
}

// retryBook keeps, per name, the consecutive failures and when the next
// attempt may be made. It is safe for concurrent use.
type retryBook struct {
	path      string // empty: not persisted
	base, max time.Duration
	settings  string
	log       *slog.Logger

	mu      sync.Mutex
	entries map[string]*retryEntry
}

func newRetryBook(path string, base, ceiling time.Duration, settings string, log *slog.Logger) *retryBook {
	if base <= 0 {
		base = defaultRetryBase
	}
	if ceiling <= 0 {
		ceiling = defaultRetryMax
	}
	return &retryBook{path: path, base: base, max: max(base, ceiling), settings: settings, log: log, entries: map[string]*retryEntry{}}
}

// delay is the wait after the n-th consecutive failure (n ≥ 1).
func (b *retryBook) delay(n int) time.Duration {
	d := b.base
	for i := 1; i < n && d < b.max; i++ {
		d *= 2
	}
	return min(d, b.max)
}

// load reads the book from disk. A missing file is an empty book; an
// unreadable one is logged and replaced.
func (b *retryBook) load(now time.Time) {
	if b.path == "" {
		return
	}
	data, err := os.ReadFile(b.path)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	var entries map[string]*retryEntry
	if err == nil {
		err = json.Unmarshal(data, &entries)
	}
	if err != nil {
		b.log.Warn("retry state unreadable; starting without it", "file", b.path, "err", err)
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for name, e := range entries {
		if e == nil || e.Failures <= 0 {
			continue
		}
		if e.Settings != b.settings && e.NextAttempt.After(now) {
			b.log.Info("certificate settings changed since the last failed attempt; trying again at once", "name", name, "failures", e.Failures)
			e.NextAttempt = now
		} else if e.NextAttempt.After(now) {
			b.log.Warn("certificate attempts failed recently; waiting out the backoff before the next",
				"name", name, "failures", e.Failures, "reason", e.Reason, "err", e.Error,
				"next_attempt", e.NextAttempt.UTC().Format(time.RFC3339), "state_file", b.path)
		}
		b.entries[name] = e
	}
}

// due reports whether an attempt for name may be made at now, and if
// not, when.
func (b *retryBook) due(name string, now time.Time) (bool, time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.entries[name]
	if e == nil || !now.Before(e.NextAttempt) {
		return true, time.Time{}
	}
	return false, e.NextAttempt
}

// begin records an attempt starting now, counted as failed until
// succeed. The next attempt is not due before the backoff has passed.
func (b *retryBook) begin(name, kind string, now time.Time) {
	b.mu.Lock()
	e := b.entryLocked(name)
	e.Failures++
	e.inFlight = true
	e.Kind = kind
	e.LastAttempt = now
	e.NextAttempt = now.Add(b.delay(e.Failures))
	e.Settings = b.settings
	b.saveLocked(now)
	b.mu.Unlock()
}

// fail records a failed attempt ending now: the next is due after the
// backoff, or after retryAfter if the CA asked for later. It counts the
// failure in counts (nil: nowhere) first, so whoever sees the failure in
// Status finds it in Stats too.
func (b *retryBook) fail(counts *counters, name, kind string, err error, now time.Time) retryEntry {
	reason, retryAfter := failureReason(err)
	if counts != nil {
		counts.failure(kind, reason)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.entryLocked(name)
	if !e.inFlight {
		e.Failures++
		e.LastAttempt = now
	}
	e.inFlight = false
	e.Kind, e.Reason, e.Error, e.Settings = kind, reason, err.Error(), b.settings
	e.NextAttempt = now.Add(b.delay(e.Failures))
	if retryAfter.After(e.NextAttempt) {
		e.NextAttempt = retryAfter
	}
	b.saveLocked(now)
	return *e
}

// succeed forgets name's failures.
func (b *retryBook) succeed(name string, now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.entries[name]; ok {
		delete(b.entries, name)
		b.saveLocked(now)
	}
}

// entry returns name's record, if it has one.
func (b *retryBook) entry(name string) (retryEntry, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if e := b.entries[name]; e != nil {
		return *e, true
	}
	return retryEntry{}, false
}

// nextAttempt is the earliest next attempt of any name with failures.
func (b *retryBook) nextAttempt() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	var first time.Time
	for _, e := range b.entries {
		if first.IsZero() || e.NextAttempt.Before(first) {
			first = e.NextAttempt
		}
	}
	return first
}

func (b *retryBook) entryLocked(name string) *retryEntry {
	e := b.entries[name]
	if e == nil {
		e = &retryEntry{}
		b.entries[name] = e
	}
	return e
}

// saveLocked writes the book atomically (a write that fails leaves the
// previous file); it drops the oldest entries past maxRetryEntries.
func (b *retryBook) saveLocked(now time.Time) {
	for len(b.entries) > maxRetryEntries {
		names := slices.SortedFunc(maps.Keys(b.entries), func(x, y string) int {
			return b.entries[x].LastAttempt.Compare(b.entries[y].LastAttempt)
		})
		delete(b.entries, names[0])
	}
	if b.path == "" {
		return
	}
	data, err := json.MarshalIndent(b.entries, "", "  ")
	if err == nil {
		err = writeFileAtomic(b.path, data)
	}
	if err != nil {
		b.log.Warn("could not save retry state; a restart would not know of recent failures", "file", b.path, "err", err)
	}
}

func writeFileAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// retryAfterDetail finds the time a CA's rate-limit problem says to retry
// after (Let's Encrypt: "..., retry after 2025-01-02 03:04:05 UTC: see
// ..."); acmez does not expose the Retry-After header of an error.
var retryAfterDetail = regexp.MustCompile(`retry after (\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?: ?UTC|Z)?`)

// rateLimitFloor is the least wait after a rate-limit problem that does
// not say for how long.
const rateLimitFloor = time.Hour

func parseRetryAfter(detail string, now time.Time) time.Time {
	m := retryAfterDetail.FindStringSubmatch(detail)
	if m == nil {
		return now.Add(rateLimitFloor)
	}
	for _, layout := range []string{"2006-01-02 15:04:05", "2006-01-02T15:04:05"} {
		if t, err := time.ParseInLocation(layout, m[1], time.UTC); err == nil {
			return t
		}
	}
	return now.Add(rateLimitFloor)
}

// describeRetry is the sentence a refusal or /healthz gives for e.
func describeRetry(e retryEntry) string {
	return fmt.Sprintf("%d failed attempt(s), the last at %s (%s: %s); next attempt at %s",
		e.Failures, e.LastAttempt.UTC().Format(time.RFC3339), e.Reason, e.Error, e.NextAttempt.UTC().Format(time.RFC3339))
}
