package yamux

import (
	"bytes"
	"io"
	"sync"
	"testing"
)

// inputConn feeds a session the fuzzer's bytes, then EOF, and discards
// what the session writes.
type inputConn struct{ r *bytes.Reader }

func (c inputConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c inputConn) Write(p []byte) (int, error) { return len(p), nil }
func (c inputConn) Close() error                { return nil }

// frame encodes one frame: a header and its body.
func frame(typ uint8, flags uint16, id, length uint32, body []byte) []byte {
	h := header(make([]byte, headerSize))
	h.encode(typ, flags, id, length)
	return append(h, body...)
}

// FuzzSessionInput: whatever a peer sends, a session neither panics nor
// hangs: it serves the streams the bytes open, reads their data, and
// closes at the end of the input, leaving no goroutine behind.
func FuzzSessionInput(f *testing.F) {
	f.Add(frame(typeWindowUpdate, flagSYN, 1, 0, nil))
	f.Add(bytes.Join([][]byte{
		frame(typeWindowUpdate, flagSYN, 1, 0, nil),
		frame(typeData, 0, 1, 5, []byte("hello")),
		frame(typeData, flagFIN, 1, 0, nil),
	}, nil))
	f.Add(bytes.Join([][]byte{
		frame(typePing, flagSYN, 0, 7, nil),
		frame(typeData, flagSYN, 3, 3, []byte("abc")),
		frame(typeWindowUpdate, flagRST, 3, 0, nil),
		frame(typeGoAway, 0, 0, goAwayNormal, nil),
	}, nil))
	f.Add(frame(typeData, flagSYN, 5, 1<<30, []byte("more than the window")))
	f.Fuzz(func(t *testing.T, in []byte) {
		cfg := DefaultConfig()
		cfg.EnableKeepAlive = false
		cfg.LogOutput = io.Discard
		s, err := Server(inputConn{bytes.NewReader(in)}, cfg)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for {
			st, err := s.AcceptStream()
			if err != nil {
				break // the session ended with the input
			}
			wg.Go(func() {
				io.Copy(io.Discard, st)
				st.Close()
			})
		}
		s.Close()
		wg.Wait()
	})
}
