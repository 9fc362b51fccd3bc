package mux

import "encoding/binary"

// yamux's frame header: version, type, flags, stream id, length. Only a
// data frame has a body, of the header's length; in every other frame the
// length field is a window delta, a ping's opaque value or a go-away code.
const (
	yamuxHeaderSize       = 12
	yamuxTypeData         = 0
	yamuxTypeWindowUpdate = 1
	yamuxFlagsHeld        = 0x1 | 0x2 | 0x4 // SYN, ACK, FIN
	yamuxFlagRST          = 0x8
)

// frames follows a yamux frame stream as it is written, in pieces of any
// size: a 12-byte header, then as many body bytes as a data header states.
// Its zero value is at the start of a frame.
type frames struct {
	hdr  [yamuxHeaderSize]byte
	have int    // bytes of the current frame's header seen so far
	body uint32 // body bytes of the current data frame still to come
	len  uint32 // the current data frame's body length
	bulk bool   // the current frame is queued as bulk (coalescedConn)
}

// step takes the start of p: body bytes of the current frame, or header
// bytes. It returns how many bytes it took; header, when they completed a
// header (in f.hdr); done, when they completed a frame, and then held,
// when that frame may wait for company (a stream's SYN, ACK or FIN window
// update), or else must leave now.
func (f *frames) step(p []byte) (n int, header, done, held bool) {
	if f.body > 0 {
		n = int(min(uint32(len(p)), f.body))
		f.body -= uint32(n)
		return n, false, f.body == 0, false
	}
	n = copy(f.hdr[f.have:], p)
	if f.have += n; f.have < yamuxHeaderSize {
		return n, false, false, false
	}
	f.have = 0
	typ, flags, length := f.hdr[1], binary.BigEndian.Uint16(f.hdr[2:]), binary.BigEndian.Uint32(f.hdr[8:])
	if typ == yamuxTypeData && length > 0 {
		f.body, f.len = length, length
		return n, true, false, false
	}
	held = typ == yamuxTypeWindowUpdate && flags&yamuxFlagsHeld != 0 && flags&yamuxFlagRST == 0
	return n, true, true, held
}

// stream is the stream id of the frame whose header f.hdr holds.
func (f *frames) stream() uint32 { return binary.BigEndian.Uint32(f.hdr[4:]) }

// length is the length field of the header f.hdr holds.
func (f *frames) length() uint32 { return binary.BigEndian.Uint32(f.hdr[8:]) }

// lone reports whether the current frame is a data header with none of
// its body yet: its 12 bytes must not leave without the body.
func (f *frames) lone() bool { return f.body > 0 && f.body == f.len }

// pending is how many of the bytes taken so far belong to a frame that has
// nothing but (part of) its header: a partial header, which step keeps in
// f.hdr, or a lone data header.
func (f *frames) pending() int {
	if f.lone() {
		return yamuxHeaderSize
	}
	return f.have
}
