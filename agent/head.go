package agent

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strconv"
)

// head is an HTTP/1.x request or response head as the relay needs it: the
// bytes to pass on unchanged, and what frames the body that follows.
type head struct {
	raw     []byte // request or status line through the blank line
	status  int    // responses: the status code
	head    bool   // requests: HEAD (its response has no body)
	length  int64  // Content-Length; -1 when absent
	chunked bool   // Transfer-Encoding ends in chunked
	close   bool   // the connection ends after this message
	upgrade bool   // requests: Connection: upgrade
	replay  bool   // requests: may be sent twice (http.Transport's rule)
}

var (
	errHeadTooLarge = errors.New("agent: message head too large")
	errMalformed    = errors.New("agent: malformed HTTP/1.x message head")
	errBadLength    = errors.New("agent: invalid or conflicting Content-Length")
	errBadEncoding  = errors.New("agent: unsupported Transfer-Encoding")
	errBadChunk     = errors.New("agent: malformed chunked body")
)

// readHead appends the next message head from br to buf, up to limit
// bytes. An EOF before the first byte is io.EOF itself.
func readHead(br *bufio.Reader, buf []byte, limit int) ([]byte, error) {
	start := len(buf)
	lineStart := start
	for {
		frag, err := br.ReadSlice('\n')
		if len(buf)+len(frag)-start > limit {
			return buf, errHeadTooLarge
		}
		buf = append(buf, frag...)
		switch {
		case err == bufio.ErrBufferFull:
			continue // a long line: keep reading it
		case err != nil:
			if len(buf) > start && err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return buf, err
		}
		line := buf[lineStart:]
		lineStart = len(buf)
		if len(line) <= 2 && (len(line) == 1 || line[0] == '\r') {
			if len(buf)-start == len(line) {
				// Blank lines before a message are tolerated (RFC 9112, 2.2).
				buf = buf[:start]
				lineStart = start
				continue
			}
			return buf, nil
		}
	}
}

// parseRequest reads the framing of a request head made by the edge.
func parseRequest(raw []byte) (head, error) {
	h := head{raw: raw, length: -1}
	first, rest, err := firstLine(raw)
	if err != nil {
		return h, err
	}
	method, target, ok := bytes.Cut(first, []byte(" "))
	if !ok || len(method) == 0 {
		return h, errMalformed
	}
	_, proto, ok := bytes.Cut(target, []byte(" "))
	if !ok {
		return h, errMalformed
	}
	minor, ok := httpMinor(proto)
	if !ok {
		return h, errMalformed
	}
	h.head = string(method) == "HEAD"
	switch string(method) {
	case "GET", "HEAD", "OPTIONS", "TRACE":
		h.replay = true
	}
	err = h.fields(rest, minor, func(name []byte) {
		if asciiEqualFold(name, "Idempotency-Key") || asciiEqualFold(name, "X-Idempotency-Key") {
			h.replay = true
		}
	})
	if h.chunked || h.length > 0 {
		h.replay = false
	}
	return h, err
}

// parseResponse reads the framing of a local service's response head.
// HEAD requests and statuses without a body are the caller's to apply.
func parseResponse(raw []byte) (head, error) {
	h := head{raw: raw, length: -1}
	first, rest, err := firstLine(raw)
	if err != nil {
		return h, err
	}
	proto, status, ok := bytes.Cut(first, []byte(" "))
	if !ok {
		return h, errMalformed
	}
	minor, ok := httpMinor(proto)
	if !ok {
		return h, errMalformed
	}
	code, _, _ := bytes.Cut(status, []byte(" "))
	if len(code) != 3 {
		return h, errMalformed
	}
	n, err := strconv.Atoi(string(code))
	if err != nil || n < 100 {
		return h, errMalformed
	}
	h.status = n
	return h, h.fields(rest, minor, nil)
}

// fields applies a head's header section to its framing, calling also (if
// not nil) with each field name, then HTTP/1.0's rules.
func (h *head) fields(block []byte, minor int, also func(name []byte)) error {
	keepAlive := false
	err := eachHeader(block, func(name, value []byte) error {
		if also != nil {
			also(name)
		}
		return h.frame(name, value, &keepAlive)
	})
	if minor == 0 {
		// HTTP/1.0 has no Transfer-Encoding (net/http ignores it too).
		h.chunked = false
		h.close = h.close || !keepAlive
	}
	return err
}

// frame applies one header field to the message's framing.
func (h *head) frame(name, value []byte, keepAlive *bool) error {
	switch {
	case asciiEqualFold(name, "Content-Length"):
		n, err := strconv.ParseInt(string(value), 10, 64)
		if err != nil || n < 0 || (h.length >= 0 && h.length != n) {
			return errBadLength
		}
		h.length = n
	case asciiEqualFold(name, "Transfer-Encoding"):
		// Only chunked, last, frames a body this relay can find the
		// end of; net/http at both ends supports nothing else either.
		codings := bytes.Split(value, []byte(","))
		if !asciiEqualFold(bytes.TrimSpace(codings[len(codings)-1]), "chunked") {
			return errBadEncoding
		}
		h.chunked = true
	case asciiEqualFold(name, "Connection"):
		for tok := range bytes.SplitSeq(value, []byte(",")) {
			tok = bytes.TrimSpace(tok)
			switch {
			case asciiEqualFold(tok, "close"):
				h.close = true
			case asciiEqualFold(tok, "keep-alive"):
				*keepAlive = true
			case asciiEqualFold(tok, "upgrade"):
				h.upgrade = true
			}
		}
	}
	return nil
}

// bodyless reports whether a response to req with this head has no body.
func (h *head) bodyless(req *head) bool {
	return req.head || h.status < 200 || h.status == 204 || h.status == 304
}

// firstLine splits off the head's first line, without its line ending.
func firstLine(raw []byte) (line, rest []byte, err error) {
	i := bytes.IndexByte(raw, '\n')
	if i < 0 {
		return nil, nil, errMalformed
	}
	return bytes.TrimSuffix(raw[:i], []byte("\r")), raw[i+1:], nil
}

// httpMinor returns the minor version of an HTTP/1.x protocol name.
func httpMinor(proto []byte) (int, bool) {
	if len(proto) != 8 || string(proto[:7]) != "HTTP/1." || proto[7] < '0' || proto[7] > '9' {
		return 0, false
	}
	return int(proto[7] - '0'), true
}

// eachHeader calls f for each field of a head's header block (the lines
// after the first, through the blank line).
func eachHeader(block []byte, f func(name, value []byte) error) error {
	for len(block) > 0 {
		i := bytes.IndexByte(block, '\n')
		if i < 0 {
			return errMalformed
		}
		line := bytes.TrimSuffix(block[:i], []byte("\r"))
		block = block[i+1:]
		if len(line) == 0 {
			return nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			return errMalformed // obsolete line folding (RFC 9112, 5.2)
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || len(name) == 0 || bytes.ContainsAny(name, " \t") {
			return errMalformed
		}
		if err := f(name, bytes.TrimSpace(value)); err != nil {
			return err
		}
	}
	return errMalformed
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range len(b) {
		c, d := b[i], s[i]
		if c|0x20 != d|0x20 || (c|0x20 < 'a' || c|0x20 > 'z') && c != d {
			return false
		}
	}
	return true
}

// chunkSize parses a chunk-size line ("1a;ext=v\r\n"). A bare LF ends no
// chunk line: net/http refuses it (a request smuggling vector).
func chunkSize(line []byte) (int64, error) {
	line, ok := bytes.CutSuffix(line, []byte("\r\n"))
	if !ok {
		return 0, errBadChunk
	}
	if i := bytes.IndexByte(line, ';'); i >= 0 {
		line = line[:i]
	}
	line = bytes.TrimRight(line, " \t")
	if len(line) == 0 || len(line) > 15 {
		return 0, errBadChunk
	}
	var n int64
	for _, c := range line {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, errBadChunk
		}
		n = n<<4 | int64(c)
	}
	return n, nil
}

// setHost appends to dst the request head raw with the value of its Host
// field replaced by host (--host-header); every other line is copied as it
// is. The edge writes exactly one Host field.
func setHost(dst, raw []byte, host string) []byte {
	done := false
	for i := 0; len(raw) > 0; i++ {
		n := bytes.IndexByte(raw, '\n') + 1
		if n == 0 {
			n = len(raw)
		}
		line := raw[:n]
		raw = raw[n:]
		if name, _, ok := bytes.Cut(line, []byte(":")); i > 0 && !done && ok && asciiEqualFold(name, "Host") {
			dst = append(dst, "Host: "...)
			dst = append(dst, host...)
			dst = append(dst, "\r\n"...)
			done = true
			continue
		}
		dst = append(dst, line...)
	}
	return dst
}
