package mux

import (
	"encoding/binary"
	"testing"
)

// scan follows p through the stream as the coalescer does and reports
// what the frames p completed ask for.
func scan(f *frames, p []byte) (urgent, held bool) {
	for len(p) > 0 {
		n, _, done, h := f.step(p)
		p = p[n:]
		if done {
			urgent, held = urgent || !h, held || h
		}
	}
	return urgent, held
}

// refFrame is one frame of a whole stream, parsed at once.
type refFrame struct {
	start, end   int // end is past the stream's end for a frame cut short
	hasBody      bool
	urgent, held bool
}

// parseFrames parses a whole frame stream the plain way.
func parseFrames(stream []byte) []refFrame {
	var out []refFrame
	for at := 0; at < len(stream); {
		f := refFrame{start: at, end: at + yamuxHeaderSize}
		if at+yamuxHeaderSize > len(stream) {
			out = append(out, f)
			break
		}
		h := stream[at:]
		typ, flags, length := h[1], binary.BigEndian.Uint16(h[2:]), binary.BigEndian.Uint32(h[8:])
		switch {
		case typ == yamuxTypeData && length > 0:
			f.end += int(length)
			f.hasBody, f.urgent = true, true
		case typ == yamuxTypeWindowUpdate && flags&yamuxFlagsHeld != 0 && flags&yamuxFlagRST == 0:
			f.held = true
		default:
			f.urgent = true
		}
		out = append(out, f)
		at = f.end
	}
	return out
}

// FuzzFrames: written in pieces of any size, the frame stream is followed
// as a plain parse of the whole stream sees it: each piece reports the
// frames it completes, and the bytes a flush keeps back after it are those
// of a frame with nothing but (part of) its header.
func FuzzFrames(f *testing.F) {
	hdr := func(typ byte, flags uint16, length uint32) []byte {
		return frameHeader(typ, flags, 1, length)
	}
	f.Add(append(append(hdr(0, 0, 12), hdr(0, 0, 5)...), hdr(1, 1, 0)...), []byte{12, 12, 12})
	f.Add(append(append(hdr(1, 2, 9), hdr(2, 1, 3)...), append(hdr(0, 1, 3), 'a', 'b', 'c')...), []byte{5, 20, 1, 1, 30})
	f.Add(append(hdr(0, 0, 0), hdr(1, 8, 0)...), []byte{24})
	f.Fuzz(func(t *testing.T, stream, cuts []byte) {
		if len(stream) > 1<<16 {
			return
		}
		ref := parseFrames(stream)
		var fr frames
		at := 0
		for i := 0; at < len(stream); i++ {
			n := len(stream) - at
			if i < len(cuts) && int(cuts[i]) < n {
				n = max(1, int(cuts[i]))
			}
			urgent, held := scan(&fr, stream[at:at+n])
			var wantUrgent, wantHeld bool
			wantPending := 0
			for _, rf := range ref {
				if rf.end > at && rf.end <= at+n {
					wantUrgent = wantUrgent || rf.urgent
					wantHeld = wantHeld || rf.held
				}
				if rf.start < at+n && at+n < rf.end {
					switch in := at + n - rf.start; {
					case in < yamuxHeaderSize:
						wantPending = in
					case in == yamuxHeaderSize && rf.hasBody:
						wantPending = yamuxHeaderSize
					}
				}
			}
			if urgent != wantUrgent || held != wantHeld || fr.pending() != wantPending {
				t.Fatalf("piece %d..%d: urgent %v held %v pending %d; the whole stream says %v %v %d",
					at, at+n, urgent, held, fr.pending(), wantUrgent, wantHeld, wantPending)
			}
			at += n
		}
	})
}
