//go:build !linux

package mux

import "time"

// tcpRTT is unknown here: sessions get MinWindow.
func tcpRTT(uintptr) time.Duration { return 0 }

// tcpSendRate is unknown here: the unsent limit follows the chunk alone.
func tcpSendRate(uintptr) int { return 0 }

// sendBufferFor leaves the send buffer to the system here.
func sendBufferFor(int) int { return 0 }
