//go:build !linux

package mux

import "time"

// tcpRTT is unknown here: sessions get MinWindow.
func tcpRTT(uintptr) time.Duration { return 0 }
