package agent_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestUpgradedFramesEchoAtOnce: an upgraded connection through a real edge
// and agent carries, both ways, messages of 12 bytes shaped like yamux's
// own frames (a data header, window updates with each flag, a ping, a
// go-away) and messages of every length from 1 to 64, and each comes back
// from the backend's echo within 100 ms. The sessions' keepalive and the
// agent's heartbeats are minutes apart, so that no other frame can push a
// message held by mistake out in time.
func TestUpgradedFramesEchoAtOnce(t *testing.T) {
	be := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		brw.Flush()
		conn.SetDeadline(time.Now().Add(time.Minute))
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
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(time.Minute))
	io.WriteString(conn, "GET /ws HTTP/1.1\r\nHost: frames."+tunneltest.Domain+"\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v, %v; want 101", resp, err)
	}
	for i, msg := range frameShapedMessages() {
		start := time.Now()
		conn.SetDeadline(start.Add(10 * time.Second))
		if _, err := conn.Write(msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(br, got); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("message %d (%x): echo %x, %v", i, msg, got, err)
		}
		if d := time.Since(start); d > 100*time.Millisecond {
			t.Errorf("message %d (%d bytes, %x) echoed after %v, want within 100ms", i, len(msg), msg, d)
		}
	}
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
