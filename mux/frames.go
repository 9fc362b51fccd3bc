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
}

// scan follows p through the stream and reports what the frames it
// completed ask for: urgent, one must leave now; held, one (a stream's
// SYN, ACK or FIN window update) may wait for company.
func (f *frames) scan(p []byte) (urgent, held bool) {
	for len(p) > 0 {
		if f.body > 0 {
			n := min(uint32(len(p)), f.body)
			f.body -= n
			p = p[n:]
			urgent = urgent || f.body == 0
			continue
		}
		n := copy(f.hdr[f.have:], p)
		f.have += n
		p = p[n:]
		if f.have < yamuxHeaderSize {
			break
		}
		f.have = 0
		typ, flags, length := f.hdr[1], binary.BigEndian.Uint16(f.hdr[2:]), binary.BigEndian.Uint32(f.hdr[8:])
		switch {
		case typ == yamuxTypeData && length > 0:
			f.body, f.len = length, length
		case typ == yamuxTypeWindowUpdate && flags&yamuxFlagsHeld != 0 && flags&yamuxFlagRST == 0:
			held = true
		default:
			urgent = true
		}
	}
	return urgent, held
}

// pending is how many of the last bytes scanned belong to a frame that has
// nothing but (part of) its header so far: a flush keeps them back, so
// that a header never leaves without its body.
func (f *frames) pending() int {
	if f.body > 0 && f.body == f.len {
		return yamuxHeaderSize
	}
	return f.have
}
