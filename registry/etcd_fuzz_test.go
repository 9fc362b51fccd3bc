package registry

import (
	"encoding/json"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// FuzzEtcdEvent feeds the watch arbitrary keys and values, as a broken or
// hostile writer to the shared etcd could, over a cache that holds a
// binding of this node: the route cache must neither crash nor hold a
// route (a binding, or a pool sealed from a member) whose value did not
// decode, and only a binding of this node that the change ended is
// reported taken over.
func FuzzEtcdEvent(f *testing.F) {
	f.Add("hosts/app.example.com", []byte(`{"instance_id":"a","session_id":1,"node":"n1"}`), int64(5), false)
	f.Add("hosts/app.example.com", []byte(`{`), int64(7), true)
	f.Add("hosts/mine.example.com", []byte(`{"node":"n2","session_id":9}`), int64(8), false)
	f.Add("hosts/mine.example.com", []byte(`{"node":"n1","session_id":1}`), int64(9), false)
	f.Add("nodes/n1", []byte(`{"addr":"10.0.0.1:7443"}`), int64(2), false)
	f.Add("sessions/n1/7", []byte(""), int64(3), true)
	f.Add("reserved/mine.example.com", []byte(`{"token_id":"t","for":60000000000}`), int64(10), false)
	f.Add("hosts/", []byte(`null`), int64(-1), false)
	f.Add("members/app.example.com/n2/3", []byte(`{"token_id":"t","session_id":3,"node":"n2","down":"refused"}`), int64(11), false)
	f.Add("members/mine.example.com/n2/3", []byte(`{"token_id":"t","session_id":3,"node":"n2"}`), int64(12), false)
	f.Add("members/mine.example.com/n1/1", []byte(`{"session_id":1,"node":"n1"}`), int64(4), true)
	f.Add("members/mine.example.com", []byte(`{}`), int64(13), false)
	f.Add("members//n1/1", []byte(`{"down":7}`), int64(14), false)
	f.Fuzz(func(t *testing.T, key string, val []byte, rev int64, del bool) {
		var told []Binding
		s := NewEtcd(EtcdConfig{Prefix: "/p/", Node: "n1"})
		s.hooks = Hooks{TakenOver: func(b Binding) { told = append(told, b) }}
		mine := Binding{Hostname: "mine.example.com", Node: "n1", SessionID: 1, Generation: 6}
		s.routes[mine.Hostname] = mine
		ev := &clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: []byte("/p/" + key), Value: val, ModRevision: rev}}
		if del {
			ev.Type = mvccpb.DELETE
		}
		s.event(ev)
		for h, b := range s.routes {
			if b.Hostname != h {
				t.Fatalf("route %q holds binding of %q", h, b.Hostname)
			}
			if reflect.DeepEqual(b, mine) {
				continue
			}
			if _, err := s.decode(h, val, rev); err != nil || del {
				t.Fatalf("route %q kept although its value does not decode or was deleted: %v", h, err)
			}
		}
		now, still := s.routes[mine.Hostname]
		ended := !still || now.Node != mine.Node || now.SessionID != mine.SessionID
		if ended != (len(told) == 1) || len(told) > 1 || (len(told) == 1 && !reflect.DeepEqual(told[0], mine)) {
			t.Fatalf("cache now %+v (%v); told %+v", now, still, told)
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
