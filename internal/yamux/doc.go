// Package yamux is github.com/hashicorp/yamux v0.1.2, the multiplexer
// DESIGN.md names, copied here under its licence (MPL-2.0, LICENSE in this
// directory) with two changes:
//
//   - in stream.go, a stream's receive buffer (recvBuffer) never grows past
//     the stream's window;
//   - in session.go and mux.go, Config.CloseLinger: Close of a session that
//     met no error can half-close its connection and wait for the peer to
//     close, so that the kernel does not reset a connection that still has
//     unread bytes and drop the tail of what was written (off unless set;
//     ngstone's agent sets it).
//
// Upstream keeps received data in a bytes.Buffer filled by io.Copy. That
// buffer doubles whenever a frame fills it exactly, and when the reader lags
// it grows to about twice the window, leaving each smaller buffer behind as
// garbage. With ngstone's 1 MiB window that was 2 MiB of heap per busy
// stream and the garbage on the way, which put the edge's peak memory under
// a 64 MiB transfer over 30 MiB (BENCHMARKS.md, fourth round).
//
// The wire protocol is untouched: the tests in internal/tunneltest and
// TestInteropUpstream run this package against the upstream module.
// Upstream's tests come along. One, TestHalfCloseSessionShutdown, lingers
// on close, reads until all the data is there, and accepts a network error
// that a read returns together with its data (a comment there says why):
// upstream's version failed in about one run in ten under the race
// detector with other work running (18 of 300 here, with two CPU hogs),
// and fails none of 300 with the linger. Keep the changes small, so that upstream releases can
// be merged in by diffing against v0.1.2.
package yamux
