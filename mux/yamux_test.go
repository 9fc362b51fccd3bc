package mux

import (
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
		yc.MaxStreamWindowSize != d.StreamWindow || yc.AcceptBacklog != d.AcceptBacklog || yc.LogOutput == nil {
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
