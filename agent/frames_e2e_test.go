package agent_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestUpgradedFramesEchoAtOnce: an upgraded connection through a real edge
// and agent carries, both ways, messages of 12 bytes shaped like yamux's
// own frames (a data header, window updates with each flag, a ping, a
// go-away) and messages of every length from 1 to 64, and each comes back
// from the backend's echo at once. The sessions' keepalive and the agent's
// heartbeats are an hour apart, so that no other frame can push a message
// held by mistake out: such a message never comes. The bound of each echo
// is sized for -race on two busy cores (echoLimit); the figure itself,
// well under 100 ms, is BenchmarkUpgradedEcho's.
func TestUpgradedFramesEchoAtOnce(t *testing.T) {
	conn, br := upgradedEcho(t)
	var slowest time.Duration
	for i, msg := range frameShapedMessages() {
		d, err := echo(conn, br, msg)
		if err != nil {
			t.Fatalf("message %d (%x): %v", i, msg, err)
		}
		if d > echoLimit {
			t.Errorf("message %d (%d bytes, %x) echoed after %v, want within %v", i, len(msg), msg, d, echoLimit)
		}
		slowest = max(slowest, d)
	}
	t.Logf("slowest echo %v", slowest)
}

// echoLimit bounds one echo in TestUpgradedFramesEchoAtOnce: far above
// what a loaded machine adds, far below the hour a held message waits.
const echoLimit = 2 * time.Second

// BenchmarkUpgradedEcho times the echoes of TestUpgradedFramesEchoAtOnce's
// messages, one at a time: ns/op is one echo; the slowest-ms and p99-ms
// metrics are over all of them.
//
//	go test -run XXX -bench UpgradedEcho -benchtime 20x ./agent
func BenchmarkUpgradedEcho(b *testing.B) {
	conn, br := upgradedEcho(b)
	msgs := frameShapedMessages()
	var ds []time.Duration
	b.ResetTimer()
	for range b.N {
		for i, msg := range msgs {
			d, err := echo(conn, br, msg)
			if err != nil {
				b.Fatalf("message %d (%x): %v", i, msg, err)
			}
			ds = append(ds, d)
		}
	}
	b.StopTimer()
	slices.Sort(ds)
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(len(ds)), "ns/op")
	b.ReportMetric(float64(ds[len(ds)-1].Microseconds())/1000, "slowest-ms")
	b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds())/1000, "p99-ms")
}

// echo writes msg and reads it back, within 10 s.
func echo(conn net.Conn, br *bufio.Reader, msg []byte) (time.Duration, error) {
	start := time.Now()
	conn.SetDeadline(start.Add(10 * time.Second))
	if _, err := conn.Write(msg); err != nil {
		return 0, err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(br, got); err != nil {
		return 0, err
	}
	if !bytes.Equal(got, msg) {
		return 0, fmt.Errorf("echo %x", got)
	}
	return time.Since(start), nil
}

// upgradedEcho starts a backend that echoes an upgraded connection, an
// edge and an agent with keepalives and heartbeats an hour apart, and
// returns a visitor's upgraded connection through them.
func upgradedEcho(t testing.TB) (net.Conn, *bufio.Reader) {
	be := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		brw.Flush()
		conn.SetDeadline(time.Now().Add(10 * time.Minute))
		buf := make([]byte, 4096)
		for {
			n, err := brw.Read(buf)
			if n > 0 {
				if _, err := conn.Write(buf[:n]); err != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}))
	t.Cleanup(be.Close)
	ecfg := tunneltest.EdgeConfig(t)
	ecfg.Mux.KeepAliveInterval = time.Hour
	ecfg.HeartbeatTimeout = time.Hour
	e := tunneltest.StartEdge(t, ecfg)
	cfg := e.AgentConfig("", be.Listener.Addr().String())
	cfg.Subdomain = "frames"
	cfg.Mux.KeepAliveInterval = time.Hour
	cfg.HeartbeatInterval, cfg.HeartbeatTimeout = 10*time.Minute, time.Hour
	tunneltest.StartAgent(t, cfg).WaitOnline(t)

	conn, err := net.Dial("tcp", e.Addr("http").String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(time.Minute))
	io.WriteString(conn, "GET /ws HTTP/1.1\r\nHost: frames."+tunneltest.Domain+"\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v, %v; want 101", resp, err)
	}
	return conn, br
}

// frameShapedMessages are 12-byte messages laid out as yamux headers, then
// messages of 1 to 64 bytes.
func frameShapedMessages() [][]byte {
	hdr := func(typ byte, flags uint16, id, length uint32) []byte {
		h := make([]byte, 12)
		h[1] = typ
		binary.BigEndian.PutUint16(h[2:], flags)
		binary.BigEndian.PutUint32(h[4:], id)
		binary.BigEndian.PutUint32(h[8:], length)
		return h
	}
	msgs := [][]byte{
		hdr(0, 0, 1, 5), hdr(0, 0, 3, 1<<20), hdr(0, 1, 5, 12), hdr(0, 2, 7, 64),
		hdr(1, 0, 1, 1<<18), hdr(1, 1, 3, 0), hdr(1, 2, 5, 0), hdr(1, 4, 7, 0), hdr(1, 8, 9, 0),
		hdr(2, 1, 0, 42), hdr(2, 2, 0, 42), hdr(3, 0, 0, 0),
	}
	for n := 1; n <= 64; n++ {
		m := make([]byte, n)
		for i := range m {
			m[i] = byte(i * 13)
		}
		if n == 12 {
			copy(m, hdr(0, 0, 11, 100))
		}
		msgs = append(msgs, m)
	}
	return msgs
}
