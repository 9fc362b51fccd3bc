package mux

import (
	"net"
	"testing"
	"time"
)

func TestYamuxConfig(t *testing.T) {
	yc, err := Config{}.Yamux(nil)
	if err != nil {
		t.Fatal(err)
	}
	d := DefaultConfig()
	if !yc.EnableKeepAlive || yc.KeepAliveInterval != d.KeepAliveInterval ||
		yc.ConnectionWriteTimeout != d.ConnectionWriteTimeout ||
		yc.MaxStreamWindowSize != MinWindow || yc.AcceptBacklog != d.AcceptBacklog || yc.LogOutput == nil {
		t.Fatalf("zero Config did not yield the defaults: %+v", yc)
	}
	yc, err = Config{KeepAliveInterval: 20 * time.Millisecond, ConnectionWriteTimeout: time.Second}.Yamux(nil)
	if err != nil || yc.KeepAliveInterval != 20*time.Millisecond || yc.ConnectionWriteTimeout != time.Second {
		t.Fatalf("explicit fields not kept: %v %+v", err, yc)
	}
	if _, err := (Config{StreamWindow: 1024}).Yamux(nil); err == nil {
		t.Fatal("a window below yamux's 256 KiB minimum was accepted")
	}
}

func TestWindowFor(t *testing.T) {
	for name, tc := range map[string]struct {
		rtt  time.Duration
		want uint32
	}{
		"unknown":    {0, MinWindow},
		"loopback":   {50 * time.Microsecond, MinWindow},
		"lan":        {2 * time.Millisecond, MinWindow},
		"50ms":       {50 * time.Millisecond, 6_400_000},
		"100ms":      {100 * time.Millisecond, MaxWindow},
		"satellite":  {600 * time.Millisecond, MaxWindow},
		"first step": {9 * time.Millisecond, 1_152_000},
	} {
		if got := WindowFor(tc.rtt); got != tc.want {
			t.Errorf("%s: WindowFor(%v) = %d, want %d", name, tc.rtt, got, tc.want)
		}
	}
}

// TestYamuxConnMeasuresRoundTrip: a session over loopback TCP reads the
// kernel's round trip (non-zero once the handshake is done) and gets
// MinWindow; an explicit window is kept.
func TestYamuxConnMeasuresRoundTrip(t *testing.T) {
	client, server := tcpPair(t)
	client.Write([]byte("x"))
	server.Read(make([]byte, 1))
	if rtt := roundTrip(client); rtt <= 0 || rtt > time.Second {
		t.Errorf("loopback round trip %v", rtt)
	}
	tc, _ := tlsPair(t, client, server)
	yc, err := Config{}.YamuxConn(tc, nil)
	if err != nil || yc.MaxStreamWindowSize != MinWindow {
		t.Errorf("loopback window %d, %v; want %d", yc.MaxStreamWindowSize, err, MinWindow)
	}
	yc, err = Config{StreamWindow: 4 << 20}.YamuxConn(tc, nil)
	if err != nil || yc.MaxStreamWindowSize != 4<<20 {
		t.Errorf("explicit window became %d, %v", yc.MaxStreamWindowSize, err)
	}
	if rtt := roundTrip(struct{ net.Conn }{client}); rtt != 0 {
		t.Errorf("round trip %v through a wrapper that hides the socket", rtt)
	}
}
