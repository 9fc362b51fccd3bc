package mux

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
)

// Frame is one control message on the wire: a type and its JSON payload.
type Frame struct {
	Type    Type
	Payload []byte
}

// ReadFrame reads one frame from r. It returns ErrFrameTooLarge or
// ErrUnknownType without reading the payload, so a hostile peer cannot make
// the reader allocate more than MaxFrameSize.
func ReadFrame(r io.Reader) (Frame, error) {
	var hdr [headerSize]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return Frame{}, err
	}
	t := Type(hdr[0])
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > MaxFrameSize {
		return Frame{}, fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, n)
	}
	if !t.Known() {
		return Frame{}, fmt.Errorf("%w: %d", ErrUnknownType, hdr[0])
	}
	p := make([]byte, n)
	if _, err := io.ReadFull(r, p); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	return Frame{Type: t, Payload: p}, nil
}

// AppendFrame appends the wire form of a frame to b.
func AppendFrame(b []byte, f Frame) ([]byte, error) {
	if len(f.Payload) > MaxFrameSize {
		return b, fmt.Errorf("%w: %d bytes", ErrFrameTooLarge, len(f.Payload))
	}
	b = append(b, byte(f.Type))
	b = binary.BigEndian.AppendUint32(b, uint32(len(f.Payload)))
	return append(b, f.Payload...), nil
}

// WriteFrame writes f to w in a single Write call, so that concurrent
// writers serialised by the caller's lock never interleave partial frames.
func WriteFrame(w io.Writer, f Frame) error {
	b, err := AppendFrame(make([]byte, 0, headerSize+len(f.Payload)), f)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// Message is a control message body.
type Message interface{ MessageType() Type }

// Encode turns a message into a frame.
func Encode(m Message) (Frame, error) {
	p, err := json.Marshal(m)
	if err != nil {
		return Frame{}, fmt.Errorf("encode %s: %w", m.MessageType(), err)
	}
	return Frame{Type: m.MessageType(), Payload: p}, nil
}

// Write encodes m and writes it to w as one frame.
func Write(w io.Writer, m Message) error {
	f, err := Encode(m)
	if err != nil {
		return err
	}
	return WriteFrame(w, f)
}

// Decode turns a frame into its message. Unknown JSON fields are ignored so
// that newer peers can add fields; a payload that is not a JSON object of the
// frame's type is ErrMalformed.
func Decode(f Frame) (Message, error) {
	m := newMessage(f.Type)
	if m == nil {
		return nil, fmt.Errorf("%w: %d", ErrUnknownType, uint8(f.Type))
	}
	p := bytes.TrimSpace(f.Payload)
	if len(p) == 0 || p[0] != '{' {
		return nil, fmt.Errorf("%w: %s payload is not a JSON object", ErrMalformed, f.Type)
	}
	if err := json.Unmarshal(p, m); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrMalformed, f.Type, err)
	}
	return m, nil
}

// Read reads and decodes one message.
func Read(r io.Reader) (Message, error) {
	f, err := ReadFrame(r)
	if err != nil {
		return nil, err
	}
	return Decode(f)
}

func newMessage(t Type) Message {
	switch t {
	case TypeHello:
		return &Hello{}
	case TypeHelloOK:
		return &HelloOK{}
	case TypeBind:
		return &Bind{}
	case TypeBindOK:
		return &BindOK{}
	case TypeBindError:
		return &BindError{}
	case TypeHeartbeat:
		return &Heartbeat{}
	case TypeHeartbeatAck:
		return &HeartbeatAck{}
	case TypeEvicted:
		return &Evicted{}
	case TypeUnbind:
		return &Unbind{}
	case TypeUnbound:
		return &Unbound{}
	case TypeGoAway:
		return &GoAway{}
	case TypeError:
		return &Error{}
	case TypeRefused:
		return &Refused{}
	case TypeHealth:
		return &Health{}
	}
	return nil
}
