package registry

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

// Bolt is the store of a single edge that outlives its process: the
// bindings in a bbolt file (--data-dir/registry.db), each bind, takeover and
// release one durable transaction, with a copy in memory that lookups read
// (so the request path never touches the file).
//
// What it keeps of a binding is what the rules need across a restart: the
// hostname, the holder's instance digest, token and session, the
// generation, and when the holder was last heard from (Heard, which the
// edge calls for its live sessions every third of the freshness window, in
// one transaction). Generations come from one counter stored with every
// bind, so they never go backwards or repeat, crashes included: bbolt's
// transactions are atomic and fsynced before they are acknowledged.
// Reservations (Claim.Reserve) are kept beside the bindings, each change
// in the transaction of the bind or release that makes it, so a restart
// keeps a released port for its token too.
type Bolt struct {
	path string
	db   *bolt.DB
	live LivenessFunc
	now  func() time.Time

	mu       sync.Mutex
	bindings map[string]Binding
	reserved reservations
	lastGen  uint64
}

// The file's layout.
var (
	bindingsBucket = []byte("bindings")
	metaBucket     = []byte("meta")
	formatKey      = []byte("format")
	lastGenKey     = []byte("last_generation")
	// reservationsBucket came after the format's first files: a file
	// without it gets it when opened.
	reservationsBucket = []byte("reservations")
)

// boltFormat names the file's layout; a file with another is not ours.
const boltFormat = "ngstone-registry-v1"

// ErrNotRegistry means the file at the store's path is not an ngstone
// registry (corrupted, or another program's): start-up stops rather than
// lose it.
var ErrNotRegistry = errors.New("registry: not an ngstone registry")

// boltRecord is a binding as the file keeps it; the hostname is the key.
type boltRecord struct {
	InstanceID string    `json:"instance_id"`
	TokenID    string    `json:"token_id,omitempty"`
	SessionID  uint64    `json:"session_id"`
	Node       string    `json:"node,omitempty"`
	Generation uint64    `json:"generation"`
	BoundAt    time.Time `json:"bound_at"`
	LastHeard  time.Time `json:"last_heard"`
	Proto      string    `json:"proto,omitempty"`
	// Pool: the name is shared by Members, whose Proto and TokenID are the
	// record's.
	Pool    bool         `json:"pool,omitempty"`
	Members []boltRecord `json:"members,omitempty"`
}

// reservationRecord is a reservation as the file, and etcd, keep it; the
// key is the key.
type reservationRecord struct {
	TokenID string        `json:"token_id,omitempty"`
	Label   string        `json:"label,omitempty"`
	For     time.Duration `json:"for"`
	Until   time.Time     `json:"until,omitzero"`
}

// OpenBolt opens (or creates) the store at path; live answers rule 2
// versus rule 3 as for Memory. A file that is not a registry is an error
// naming it (ErrNotRegistry), never overwritten; one this process may not
// read and write, or cannot create, an error that matches fs.ErrPermission
// (a valid registry of another user's is no foreign file to move away); a
// file another process holds is an error after a second.
func OpenBolt(path string, live LivenessFunc) (s *Bolt, err error) {
	defer func() {
		// bbolt trusts its pages: a damaged one can make it panic.
		if p := recover(); p != nil {
			s, err = nil, fmt.Errorf("registry %s: %w: %v (move it away to start with an empty registry)", path, ErrNotRegistry, p)
		}
	}()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	switch {
	case errors.Is(err, berrors.ErrTimeout):
		return nil, fmt.Errorf("registry %s: another process (an edge on the same --data-dir?) holds it", path)
	case errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EROFS):
		return nil, accessError(path, err)
	case err != nil:
		return nil, fmt.Errorf("registry %s: %w: %v (move it away to start with an empty registry)", path, ErrNotRegistry, err)
	}
	s = &Bolt{path: path, db: db, live: live, now: time.Now, bindings: map[string]Binding{}, reserved: reservations{}}
	if err := s.load(); err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// accessError says why the registry at path could not be opened for
// writing (err) and what to do: for an existing file, give the edge's user
// access to it; for none, to its directory.
func accessError(path string, err error) error {
	who := "uid " + strconv.Itoa(os.Geteuid())
	if u, uerr := user.Current(); uerr == nil {
		who = fmt.Sprintf("user %s (uid %s)", u.Username, u.Uid)
	}
	if _, serr := os.Lstat(path); serr == nil {
		return fmt.Errorf("registry %s: the edge, running as %s, may not read and write it: %w; "+
			"the file is left as it was (it holds who owns each name): give that user read and write access to it "+
			"(chown or chmod, or mount it read-write) or run the edge as its owner", path, who, err)
	}
	return fmt.Errorf("registry %s: the edge, running as %s, cannot create it: %w; "+
		"make the directory %s writable by that user (chown or chmod), or point --data-dir at one it can write",
		path, who, err, filepath.Dir(path))
}

// load checks the file (its format and its pages) and reads every
// binding and reservation; a new file gets its format written, and a file
// from before reservations their bucket (only once it has been read as a
// registry: another program's file is never written).
func (s *Bolt) load() error {
	fresh := false
	s.db.View(func(tx *bolt.Tx) error { fresh = empty(tx); return nil })
	if !fresh {
		missing := false
		err := s.db.View(func(tx *bolt.Tx) error {
			missing = tx.Bucket(reservationsBucket) == nil
			return s.read(tx)
		})
		if err != nil || !missing {
			return err
		}
		return s.db.Update(ensureReservations)
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucket(metaBucket)
		if err == nil {
			err = meta.Put(formatKey, []byte(boltFormat))
		}
		if err == nil {
			_, err = tx.CreateBucket(bindingsBucket)
		}
		if err == nil {
			err = ensureReservations(tx)
		}
		return err
	})
}

// ensureReservations creates the reservations bucket when the file has none.
func ensureReservations(tx *bolt.Tx) error {
	_, err := tx.CreateBucketIfNotExists(reservationsBucket)
	return err
}

// read checks the file's pages and format and reads its bindings.
func (s *Bolt) read(tx *bolt.Tx) error {
	for err := range tx.Check() {
		return fmt.Errorf("registry %s: %w: %v", s.path, ErrNotRegistry, err)
	}
	meta := tx.Bucket(metaBucket)
	if meta == nil {
		return fmt.Errorf("registry %s: %w: it holds other data", s.path, ErrNotRegistry)
	}
	if f := string(meta.Get(formatKey)); f != boltFormat {
		return fmt.Errorf("registry %s: %w: format %q, want %q", s.path, ErrNotRegistry, f, boltFormat)
	}
	if v := meta.Get(lastGenKey); len(v) == 8 {
		s.lastGen = binary.BigEndian.Uint64(v)
	}
	bs := tx.Bucket(bindingsBucket)
	if bs == nil {
		return fmt.Errorf("registry %s: %w: no bindings bucket", s.path, ErrNotRegistry)
	}
	err := bs.ForEach(func(k, v []byte) error {
		var r boltRecord
		damaged := fmt.Errorf("registry %s: %w: binding %q is damaged", s.path, ErrNotRegistry, k)
		if err := json.Unmarshal(v, &r); err != nil || r.Pool != (len(r.Members) > 0) {
			return damaged
		}
		b := r.binding(string(k))
		for _, m := range b.Owners() {
			if m.Generation == 0 || m.Generation > s.lastGen {
				return damaged
			}
		}
		s.bindings[b.Hostname] = b
		return nil
	})
	if err != nil {
		return err
	}
	return s.readReservations(tx)
}

// readReservations reads the reservations bucket, if the file has one
// (load creates it after).
func (s *Bolt) readReservations(tx *bolt.Tx) error {
	rs := tx.Bucket(reservationsBucket)
	if rs == nil {
		return nil
	}
	return rs.ForEach(func(k, v []byte) error {
		var r reservationRecord
		if err := json.Unmarshal(v, &r); err != nil || r.For <= 0 {
			return fmt.Errorf("registry %s: %w: reservation %q is damaged", s.path, ErrNotRegistry, k)
		}
		key := string(k)
		s.reserved[key] = Reservation{Key: key, TokenID: r.TokenID, Label: r.Label, For: r.For, Until: r.Until}
		return nil
	})
}

func empty(tx *bolt.Tx) bool {
	n := 0
	tx.ForEach(func([]byte, *bolt.Bucket) error { n++; return nil })
	return n == 0
}

// Close closes the file.
func (s *Bolt) Close() error { return s.db.Close() }

// Bind applies the key's reservation and then the binding rules to c: one
// transaction writes the binding, the generation counter and the
// reservation, and only once it is durable does the copy in memory change.
// The liveness function is called with the lock held.
func (s *Bolt) Bind(_ context.Context, c Claim) (Result, error) {
	if c.Hostname == "" {
		return Result{}, errors.New("registry: bind: empty hostname")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if err := s.reserved.admit(c, now); err != nil {
		return Result{}, err
	}
	old, held := s.bindings[c.Hostname]
	next, res, err := bindLocal(old, held, c, s.live, s.lastGen+1, now, now)
	if err != nil {
		return Result{}, err
	}
	r, reserve := s.reserved.bound(c)
	var b *Binding
	if res.Outcome != Unchanged {
		b = &next
	}
	if err := s.commit(b, r, reserve); err != nil {
		return Result{}, fmt.Errorf("registry: bind %s: %w", c.Hostname, err)
	}
	return res, nil
}

// commit writes a bind's changes in one transaction, then to the copy in
// memory: the binding b with its generation (nil when it is unchanged) and
// the key's reservation r (if reserve).
func (s *Bolt) commit(b *Binding, r Reservation, reserve bool) error {
	if b == nil && !reserve {
		return nil
	}
	err := s.db.Update(func(tx *bolt.Tx) error {
		if b != nil {
			if err := putRecord(tx, *b); err != nil {
				return err
			}
			if err := tx.Bucket(metaBucket).Put(lastGenKey, binary.BigEndian.AppendUint64(nil, b.Generation)); err != nil {
				return err
			}
		}
		if reserve {
			return putReservation(tx, r)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if b != nil {
		s.lastGen = b.Generation
		s.bindings[b.Hostname] = *b
	}
	if reserve {
		s.reserved[r.Key] = r
	}
	return nil
}

func putRecord(tx *bolt.Tx, b Binding) error {
	v, err := json.Marshal(recordOf(b))
	if err != nil {
		return err
	}
	return tx.Bucket(bindingsBucket).Put([]byte(b.Hostname), v)
}

func recordOf(b Binding) boltRecord {
	r := boltRecord{InstanceID: b.InstanceID, TokenID: b.TokenID, SessionID: b.SessionID,
		Node: b.Node, Generation: b.Generation, BoundAt: b.BoundAt, LastHeard: b.LastHeard, Proto: b.Proto, Pool: b.Pool}
	for _, m := range b.Members {
		r.Members = append(r.Members, recordOf(m))
	}
	return r
}

func (r boltRecord) binding(host string) Binding {
	b := Binding{Hostname: host, InstanceID: r.InstanceID, TokenID: r.TokenID, SessionID: r.SessionID,
		Node: r.Node, Generation: r.Generation, BoundAt: r.BoundAt, LastHeard: r.LastHeard, Proto: r.Proto, Pool: r.Pool}
	for _, m := range r.Members {
		m.TokenID, m.Proto = r.TokenID, r.Proto
		b.Members = append(b.Members, m.binding(host))
	}
	return b
}

func putReservation(tx *bolt.Tx, r Reservation) error {
	v, err := json.Marshal(reservationRecord{TokenID: r.TokenID, Label: r.Label, For: r.For, Until: r.Until})
	if err != nil {
		return err
	}
	return tx.Bucket(reservationsBucket).Put([]byte(r.Key), v)
}

// Release is compare-and-delete on (session, generation), durable before
// it returns; the deletion and the start of the key's reservation are one
// transaction.
func (s *Bolt) Release(_ context.Context, hostname string, sessionID, generation uint64) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.bindings[hostname]
	if !ok {
		return false, nil
	}
	next, gone, ok := releaseLocal(b, sessionID, generation)
	if !ok {
		return false, nil
	}
	if !gone {
		if err := s.db.Update(func(tx *bolt.Tx) error { return putRecord(tx, next) }); err != nil {
			return false, fmt.Errorf("registry: release %s: %w", hostname, err)
		}
		s.bindings[hostname] = next
		return true, nil
	}
	r, started := s.reserved.released(hostname, s.now())
	err := s.db.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bindingsBucket).Delete([]byte(hostname)); err != nil || !started {
			return err
		}
		return putReservation(tx, r)
	})
	if err != nil {
		return false, fmt.Errorf("registry: release %s: %w", hostname, err)
	}
	delete(s.bindings, hostname)
	if started {
		s.reserved[hostname] = r
	}
	return true, nil
}

// Reservation returns key's reservation while it is in force, from memory.
func (s *Bolt) Reservation(_ context.Context, key string) (Reservation, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.reserved.get(key, s.now())
	return r, ok, nil
}

// ReservedFor returns tokenID's reservations in force with label, sorted
// by key, from memory. The expired ones stay until their key is bound
// again (a read writes nothing to the file); they are one per key.
func (s *Bolt) ReservedFor(_ context.Context, tokenID, label string) ([]Reservation, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reserved.of(tokenID, label, s.now()), nil
}

// HeardAt is when the holder of a binding, at a generation, was heard from.
type HeardAt struct {
	Hostname   string
	Generation uint64
	At         time.Time
}

// Heard records when the holders of these bindings were heard from, in
// one transaction; a binding that moved on since is left alone.
func (s *Bolt) Heard(held []HeardAt) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	changed := map[string]Binding{}
	for _, at := range held {
		b, ok := changed[at.Hostname]
		if !ok {
			b = s.bindings[at.Hostname]
		}
		if heard(&b, at) {
			changed[at.Hostname] = b
		}
	}
	if len(changed) == 0 {
		return nil
	}
	err := s.db.Update(func(tx *bolt.Tx) error {
		for _, b := range changed {
			if err := putRecord(tx, b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("registry: record heartbeats: %w", err)
	}
	for _, b := range changed {
		s.bindings[b.Hostname] = b
	}
	return nil
}

// heard sets the LastHeard of b's owner at.Generation, if it is later.
func heard(b *Binding, at HeardAt) bool {
	if !b.Pool {
		if b.Generation != at.Generation || !at.At.After(b.LastHeard) {
			return false
		}
		b.LastHeard = at.At
		return true
	}
	for i, m := range b.Members {
		if m.Generation == at.Generation && at.At.After(m.LastHeard) {
			b.Members = slices.Clone(b.Members)
			b.Members[i].LastHeard = at.At
			return true
		}
	}
	return false
}

// Get returns hostname's binding, from memory.
func (s *Bolt) Get(_ context.Context, hostname string) (Binding, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.bindings[hostname]
	return b, ok, nil
}

// List returns every binding sorted by hostname, from memory.
func (s *Bolt) List(context.Context) ([]Binding, error) {
	s.mu.Lock()
	out := make([]Binding, 0, len(s.bindings))
	for _, b := range s.bindings {
		out = append(out, b)
	}
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b Binding) int { return strings.Compare(a.Hostname, b.Hostname) })
	return out, nil
}

// LastSession is the highest session id a stored binding names: the edge
// numbers its sessions above it, so that a session of the process before
// a restart is never taken for one of this process.
func (s *Bolt) LastSession() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var m uint64
	for _, b := range s.bindings {
		for _, o := range b.Owners() {
			m = max(m, o.SessionID)
		}
	}
	return m
}
