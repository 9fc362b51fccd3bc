package mux

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"reflect"
	"runtime"
	"strings"
	"testing"
)

// TestWireValues pins every value that is part of the wire protocol. A
// failure here means a peer of another build would misread us: change
// spec.md and the protocol version, not this test.
func TestWireValues(t *testing.T) {
	types := map[Type]struct {
		value uint8
		name  string
	}{
		TypeHello: {1, "hello"}, TypeHelloOK: {2, "hello_ok"}, TypeBind: {3, "bind"},
		TypeBindOK: {4, "bind_ok"}, TypeBindError: {5, "bind_error"}, TypeHeartbeat: {6, "heartbeat"},
		TypeHeartbeatAck: {7, "heartbeat_ack"}, TypeEvicted: {8, "evicted"}, TypeUnbind: {9, "unbind"},
		TypeUnbound: {10, "unbound"}, TypeGoAway: {11, "goaway"}, TypeError: {12, "error"},
		TypeRefused: {13, "refused"}, TypeHealth: {14, "health"},
	}
	for typ, want := range types {
		if uint8(typ) != want.value || typ.String() != want.name || !typ.Known() {
			t.Errorf("type %d: got value %d name %q known %v, want %d %q true", want.value, uint8(typ), typ.String(), typ.Known(), want.value, want.name)
		}
	}
	if len(typeNames) != len(types) {
		t.Errorf("typeNames has %d types, the test pins %d: pin the new one", len(typeNames), len(types))
	}
	for _, typ := range []Type{0, 15, 255} {
		if typ.Known() || typ.String() != "unknown" {
			t.Errorf("type %d: known %v name %q, want unknown", typ, typ.Known(), typ.String())
		}
	}
	if Version != 1 || ALPN != "ngstone/1" || MaxFrameSize != 65536 || headerSize != 5 {
		t.Errorf("constants: Version %d ALPN %q MaxFrameSize %d headerSize %d", Version, ALPN, MaxFrameSize, headerSize)
	}
	codes := map[string]string{
		CodeSubdomainTaken: "subdomain_taken", CodeInvalidName: "invalid_name",
		CodeReservedName: "reserved_name", CodeUnauthorized: "unauthorized",
		CodeLimitExceeded: "limit_exceeded", CodeBadRequest: "bad_request",
		CodeShuttingDown: "shutting_down", CodeVersion: "unsupported_version",
		CodeTooManyFailures: "too_many_failures", CodeUnavailable: "unavailable",
		ReasonTakeover: "takeover",
	}
	for got, want := range codes {
		if got != want {
			t.Errorf("code %q, want %q", got, want)
		}
	}
	// What every display and the cluster registry hold of an instance.
	if d := InstanceDigest("0123456789abcdef0123456789abcdef"); d != "e57246916b2c19e4ab04dce1eabacabf" {
		t.Errorf("InstanceDigest = %s", d)
	}
	if MaxResponseHead != 1<<20 || Max1xx != 16 {
		t.Errorf("MaxResponseHead %d, Max1xx %d", MaxResponseHead, Max1xx)
	}
}

// TestFrameLayout pins the bytes of encoded frames: type byte, 4-byte
// big-endian length, JSON payload.
func TestFrameLayout(t *testing.T) {
	tests := map[string]struct {
		msg  Message
		want []byte
	}{
		"heartbeat":     {&Heartbeat{Seq: 7}, append([]byte{6, 0, 0, 0, 9}, `{"seq":7}`...)},
		"heartbeat_ack": {&HeartbeatAck{Seq: 258}, append([]byte{7, 0, 0, 0, 11}, `{"seq":258}`...)},
		"bind empty":    {&Bind{}, append([]byte{3, 0, 0, 0, 2}, `{}`...)},
		"bind": {&Bind{Subdomain: "app", Takeover: true},
			append([]byte{3, 0, 0, 0, 0x23}, `{"subdomain":"app","takeover":true}`...)},
		"hello": {&Hello{Version: 1, InstanceID: "0123456789abcdef0123456789abcdef"},
			append([]byte{1, 0, 0, 0, 0x3e}, `{"version":1,"instance_id":"0123456789abcdef0123456789abcdef"}`...)},
		"evicted": {&Evicted{Hostname: "a.example.com", Reason: ReasonTakeover},
			append([]byte{8, 0, 0, 0, 0x30}, `{"hostname":"a.example.com","reason":"takeover"}`...)},
		"evicted by": {&Evicted{Hostname: "a.example.com", Reason: ReasonTakeover, By: &Holder{OtherToken: true}},
			append([]byte{8, 0, 0, 0, 0x4a}, `{"hostname":"a.example.com","reason":"takeover","by":{"other_token":true}}`...)},
		"goaway empty": {&GoAway{}, append([]byte{11, 0, 0, 0, 2}, `{}`...)},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			var buf bytes.Buffer
			if err := Write(&buf, tt.msg); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf.Bytes(), tt.want) {
				t.Fatalf("wire bytes\n got % x\nwant % x", buf.Bytes(), tt.want)
			}
			if n := binary.BigEndian.Uint32(tt.want[1:5]); int(n) != len(tt.want)-5 {
				t.Fatalf("test vector's length field %d does not match its payload %d", n, len(tt.want)-5)
			}
		})
	}
}

// allMessages has one filled-in value of every message type.
func allMessages() []Message {
	return []Message{
		&Hello{Version: 1, InstanceID: "0123456789abcdef0123456789abcdef", Token: "tok", Agent: "ngstone"},
		&HelloOK{SessionID: 42, HeartbeatTimeoutMS: 45000},
		&Bind{Subdomain: "app", Takeover: true},
		&BindOK{Hostname: "app.example.com", URL: "https://app.example.com", Generation: 9,
			URLs: []string{"https://app.example.com", "http://app.example.com"}},
		&BindError{Subdomain: "app", Code: CodeSubdomainTaken, Message: "taken",
			By: &Holder{Instance: "0123456789abcdef0123456789abcdef", Addr: "192.0.2.7:50123"}},
		&Heartbeat{Seq: 1 << 40},
		&HeartbeatAck{Seq: 1 << 40},
		&Evicted{Hostname: "app.example.com", Reason: ReasonTakeover, By: &Holder{OtherToken: true}},
		&Unbind{Hostname: "app.example.com"},
		&Unbound{Hostname: "app.example.com"},
		&GoAway{Reason: "edge shutting down"},
		&Error{Code: CodeUnauthorized, Message: "no"},
		&Refused{Hostname: "app.example.com", Method: "POST", Path: "/hook", Code: CodeWebhookUnverified, Reason: "no X-Hub-Signature-256"},
		&Health{Hostname: "app.example.com", Down: true, Reason: "dial tcp 127.0.0.1:3000: connection refused"},
	}
}

func TestRoundTripEveryType(t *testing.T) {
	msgs := allMessages()
	if len(msgs) != len(typeNames) {
		t.Fatalf("allMessages has %d types, the protocol %d", len(msgs), len(typeNames))
	}
	var buf bytes.Buffer
	for _, m := range msgs {
		if err := Write(&buf, m); err != nil {
			t.Fatalf("write %s: %v", m.MessageType(), err)
		}
	}
	for _, want := range msgs {
		got, err := Read(&buf)
		if err != nil {
			t.Fatalf("read %s: %v", want.MessageType(), err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: got %+v, want %+v", want.MessageType(), got, want)
		}
	}
	if _, err := Read(&buf); err != io.EOF {
		t.Fatalf("read past the last frame: %v, want io.EOF", err)
	}
}

// countingReader counts the bytes read from it.
type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

func TestReadFrameRefusesOversize(t *testing.T) {
	for name, n := range map[string]uint32{"max+1": MaxFrameSize + 1, "4 GiB": 1<<32 - 1} {
		t.Run(name, func(t *testing.T) {
			hdr := binary.BigEndian.AppendUint32([]byte{byte(TypeHello)}, n)
			body := strings.Repeat("x", MaxFrameSize+1)
			// TotalAlloc counts every goroutine's allocations, and goroutines
			// of earlier tests may still be winding down (a closing session
			// frees and takes buffers). A ReadFrame that allocated the
			// frame's size would do so on every try, so the least of several
			// tries is ReadFrame's own.
			least := uint64(math.MaxUint64)
			for range 10 {
				cr := &countingReader{r: io.MultiReader(bytes.NewReader(hdr), strings.NewReader(body))}
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				_, err := ReadFrame(cr)
				runtime.ReadMemStats(&after)
				if !errors.Is(err, ErrFrameTooLarge) {
					t.Fatalf("ReadFrame: %v, want ErrFrameTooLarge", err)
				}
				if cr.n != headerSize {
					t.Fatalf("ReadFrame read %d bytes of an oversized frame, want only the %d of its header", cr.n, headerSize)
				}
				least = min(least, after.TotalAlloc-before.TotalAlloc)
			}
			if least >= MaxFrameSize/4 {
				t.Fatalf("ReadFrame allocated %d bytes for a frame it refused", least)
			}
		})
	}
}

func TestReadFrameExactlyMax(t *testing.T) {
	p := bytes.Repeat([]byte{' '}, MaxFrameSize)
	var buf bytes.Buffer
	if err := WriteFrame(&buf, Frame{Type: TypeGoAway, Payload: p}); err != nil {
		t.Fatal(err)
	}
	f, err := ReadFrame(&buf)
	if err != nil || f.Type != TypeGoAway || len(f.Payload) != MaxFrameSize {
		t.Fatalf("ReadFrame of a %d-byte payload: %v type %s len %d", MaxFrameSize, err, f.Type, len(f.Payload))
	}
	if err := WriteFrame(&buf, Frame{Type: TypeGoAway, Payload: append(p, ' ')}); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("WriteFrame of MaxFrameSize+1: %v, want ErrFrameTooLarge", err)
	}
	if buf.Len() != 0 {
		t.Fatalf("a refused WriteFrame wrote %d bytes", buf.Len())
	}
}

func TestReadFrameErrors(t *testing.T) {
	tests := map[string]struct {
		in   []byte
		want error
	}{
		"empty":                      {nil, io.EOF},
		"short header":               {[]byte{6, 0, 0}, io.ErrUnexpectedEOF},
		"short payload":              {append([]byte{6, 0, 0, 0, 9}, `{"seq"`...), io.ErrUnexpectedEOF},
		"no payload":                 {[]byte{6, 0, 0, 0, 9}, io.ErrUnexpectedEOF},
		"type zero":                  {[]byte{0, 0, 0, 0, 2, '{', '}'}, ErrUnknownType},
		"type 15":                    {[]byte{15, 0, 0, 0, 2, '{', '}'}, ErrUnknownType},
		"type 255":                   {[]byte{255, 0, 0, 0, 0}, ErrUnknownType},
		"too large":                  {[]byte{6, 0, 1, 0, 1}, ErrFrameTooLarge},
		"too large and unknown type": {[]byte{99, 0x7f, 0, 0, 0}, ErrFrameTooLarge},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := ReadFrame(bytes.NewReader(tt.in))
			if !errors.Is(err, tt.want) {
				t.Fatalf("ReadFrame(% x): %v, want %v", tt.in, err, tt.want)
			}
		})
	}
}

func TestDecodeRefusesNonObjects(t *testing.T) {
	payloads := map[string]string{
		"empty":      "",
		"spaces":     "   ",
		"null":       "null",
		"array":      "[]",
		"number":     "7",
		"string":     `"seq"`,
		"true":       "true",
		"truncated":  `{"seq":`,
		"wrong type": `{"seq":"seven"}`,
		"negative":   `{"seq":-1}`,
		"trailing":   `{"seq":1} x`,
	}
	for name, p := range payloads {
		t.Run(name, func(t *testing.T) {
			m, err := Decode(Frame{Type: TypeHeartbeat, Payload: []byte(p)})
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode(%q) = %v, %v; want ErrMalformed", p, m, err)
			}
		})
	}
	if _, err := Decode(Frame{Type: 99, Payload: []byte("{}")}); !errors.Is(err, ErrUnknownType) {
		t.Fatalf("Decode of type 99: %v, want ErrUnknownType", err)
	}
}

func TestDecodeIgnoresUnknownFields(t *testing.T) {
	m, err := Decode(Frame{Type: TypeHeartbeat, Payload: []byte(` {"seq":3,"future":{"x":[1]}} `)})
	if err != nil {
		t.Fatal(err)
	}
	if hb, ok := m.(*Heartbeat); !ok || hb.Seq != 3 {
		t.Fatalf("Decode = %#v, want &Heartbeat{Seq:3}", m)
	}
}

// onceWriter records each Write call.
type onceWriter struct{ writes [][]byte }

func (w *onceWriter) Write(p []byte) (int, error) {
	w.writes = append(w.writes, append([]byte(nil), p...))
	return len(p), nil
}

func TestWriteFrameIsOneWrite(t *testing.T) {
	w := &onceWriter{}
	if err := Write(w, &BindOK{Hostname: "a.b", URL: "https://a.b", Generation: 1}); err != nil {
		t.Fatal(err)
	}
	if len(w.writes) != 1 {
		t.Fatalf("Write made %d Write calls, want 1 so frames never interleave", len(w.writes))
	}
}

// FuzzReadFrame feeds arbitrary bytes to ReadFrame and Decode. Neither may
// panic, and a frame that decodes must re-encode to a frame that decodes to
// the same message.
func FuzzReadFrame(f *testing.F) {
	for _, m := range allMessages() {
		var buf bytes.Buffer
		if err := Write(&buf, m); err != nil {
			f.Fatal(err)
		}
		f.Add(buf.Bytes())
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fr, err := ReadFrame(bytes.NewReader(data))
		if err != nil {
			return
		}
		if len(fr.Payload) > MaxFrameSize || !fr.Type.Known() {
			t.Fatalf("ReadFrame returned type %d with %d bytes", fr.Type, len(fr.Payload))
		}
		m, err := Decode(fr)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Decode error %v is not ErrMalformed", err)
			}
			return
		}
		if m.MessageType() != fr.Type {
			t.Fatalf("frame of type %s decoded to %s", fr.Type, m.MessageType())
		}
		var buf bytes.Buffer
		if err := Write(&buf, m); err != nil {
			t.Fatalf("re-encode %#v: %v", m, err)
		}
		m2, err := Read(&buf)
		if err != nil {
			t.Fatalf("decode re-encoded %#v: %v", m, err)
		}
		// Compare wire forms: a nil and an empty slice are the same message.
		f1, err1 := Encode(m)
		f2, err2 := Encode(m2)
		if err1 != nil || err2 != nil || f1.Type != f2.Type || !bytes.Equal(f1.Payload, f2.Payload) {
			t.Fatalf("round trip changed the message:\n got %#v\nwant %#v", m2, m)
		}
	})
}

// TestHolderAcrossVersions: an evicted or bind_error of an older edge
// (without by) reads as saying nothing of the holder, and one of a newer
// edge with fields this version does not know reads as what it does know.
// A holder is named for a person by what the edge told.
func TestHolderAcrossVersions(t *testing.T) {
	read := func(typ Type, payload string) Message {
		t.Helper()
		var buf bytes.Buffer
		buf.WriteByte(byte(typ))
		buf.Write(binary.BigEndian.AppendUint32(nil, uint32(len(payload))))
		buf.WriteString(payload)
		m, err := Read(&buf)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := read(TypeEvicted, `{"hostname":"a.example.com","reason":"takeover"}`).(*Evicted); m.By != nil {
		t.Errorf("an older edge's evicted: by %+v, want nil", m.By)
	}
	if m := read(TypeBindError, `{"subdomain":"a","code":"subdomain_taken","message":"m"}`).(*BindError); m.By != nil {
		t.Errorf("an older edge's bind_error: by %+v, want nil", m.By)
	}
	m := read(TypeEvicted, `{"hostname":"a.example.com","reason":"takeover","by":{"instance":"d1","addr":"192.0.2.7:1","since":5},"later":true}`).(*Evicted)
	if m.By == nil || *m.By != (Holder{Instance: "d1", Addr: "192.0.2.7:1"}) {
		t.Errorf("a newer edge's evicted: by %+v", m.By)
	}
	for h, want := range map[Holder]string{
		{}:                                "",
		{Instance: "d1"}:                  "instance d1",
		{Instance: "d1", Addr: "a:1"}:     "instance d1 from a:1",
		{OtherToken: true}:                "an agent with another token",
		{OtherToken: true, Addr: "a"}:     "an agent with another token",
		{OtherToken: true, Instance: "d"}: "an agent with another token",
	} {
		if got := h.String(); got != want {
			t.Errorf("%+v named %q, want %q", h, got, want)
		}
	}
}
