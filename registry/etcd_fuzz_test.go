package registry

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzEtcdEvent feeds the watch arbitrary keys and values, as a broken or
// hostile writer to the shared etcd could: the route cache must neither
// crash nor hold a route whose value did not decode.
func FuzzEtcdEvent(f *testing.F) {
	f.Add("hosts/app.example.com", []byte(`{"instance_id":"a","session_id":1,"node":"n1"}`), int64(5), false, []byte(`{"node":"n2","session_id":9}`))
	f.Add("hosts/app.example.com", []byte(`{`), int64(1), true, []byte(nil))
	f.Add("nodes/n1", []byte(`{"addr":"10.0.0.1:7443"}`), int64(2), false, []byte(`{"addr":3}`))
	f.Add("sessions/n1/7", []byte(""), int64(3), true, []byte("x"))
	f.Add("hosts/", []byte(`null`), int64(-1), false, []byte(`[]`))
	f.Fuzz(func(t *testing.T, key string, val []byte, rev int64, del bool, prev []byte) {
		var told []Binding
		s := NewEtcd(EtcdConfig{Prefix: "/p/", Node: "n1"})
		s.hooks = Hooks{TakenOver: func(b Binding) { told = append(told, b) }}
		ev := etcdEvent{Kv: etcdKV{Key: []byte("/p/" + key), Value: val, ModRevision: rev}}
		if del {
			ev.Type = "DELETE"
		}
		if prev != nil {
			ev.PrevKv = &etcdKV{Key: ev.Kv.Key, Value: prev, ModRevision: rev - 1}
		}
		s.event(ev)
		for h, b := range s.routes {
			if b.Hostname != h {
				t.Fatalf("route %q holds binding of %q", h, b.Hostname)
			}
			if _, err := s.decode(h, val, rev); err != nil {
				t.Fatalf("route %q kept although its value does not decode: %v", h, err)
			}
		}
		for _, b := range told {
			if b.Node != "n1" {
				t.Fatalf("told of a takeover of another node's binding: %+v", b)
			}
		}
	})
}

// FuzzParseSession feeds the session records' reader arbitrary keys and
// values: it never fails on a value, keeps node and id from the key, and
// reads back what OpenSession writes (token and instance ids are hex,
// so valid UTF-8).
func FuzzParseSession(f *testing.F) {
	f.Add("n1/7", []byte(`{"token_id":"ab12","instance_id":"cd34"}`))
	f.Add("n1/7", []byte(""))
	f.Add("a/b/18446744073709551615", []byte(`{"token_id":3}`))
	f.Add("/1", []byte(`null`))
	f.Add("n1/-1", []byte(`{}`))
	f.Add("n1/", []byte(`[`))
	f.Fuzz(func(t *testing.T, key string, val []byte) {
		sess, ok := parseSession(key, val)
		if !ok {
			return
		}
		if sess.Node == "" || !strings.HasPrefix(key, sess.Node+"/") {
			t.Fatalf("key %q read as node %q", key, sess.Node)
		}
		if id, err := strconv.ParseUint(key[len(sess.Node)+1:], 10, 64); err != nil || id != sess.ID {
			t.Fatalf("key %q read as node %q id %d", key, sess.Node, sess.ID)
		}
		if !utf8.Valid(val) || !utf8.ValidString(key) {
			return // JSON would write U+FFFD for the invalid bytes
		}
		in := Session{TokenID: string(val), InstanceID: key}
		enc, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		back, ok := parseSession(key, enc)
		if !ok || back.TokenID != in.TokenID || back.InstanceID != in.InstanceID || back.Node != sess.Node || back.ID != sess.ID {
			t.Fatalf("round trip of %+v under %q: %+v %v", in, key, back, ok)
		}
	})
}
