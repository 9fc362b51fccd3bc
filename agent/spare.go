package agent

import "net"

// spareOpener is the listener of a session on which the agent keeps a
// stream open towards the edge in advance (mux.FeatureSpareStream).
type spareOpener interface {
	OpenSpare() (net.Conn, error)
}

// keepSpare keeps one spare stream open on so's session for the edge's
// next request with a large body. A stream the edge opens may carry only
// yamux's first window (256 KiB) until the agent's acceptance reaches the
// edge, a round trip later, and the edge waits for it before it sends such
// a body (mux.InitialWindow); a stream the agent opened grants the edge
// its whole window from the start. The spare waits, with no deadline, for
// the first byte of a request; it is then served as a stream the edge
// opened would be, and the next spare is opened. A spare the edge closes
// unused (it took it for a visitor who left before the request was
// written) is replaced too, but not after maxUnusedSpares in a row: such
// an edge does not want them. The keeper ends with the session.
func (a *Agent) keepSpare(so spareOpener, sl *streamListener, w *workers) {
	for unused := 0; unused < maxUnusedSpares; {
		st, err := so.OpenSpare()
		if err != nil {
			return
		}
		var b [1]byte
		if n, _ := st.Read(b[:]); n == 0 {
			st.Close()
			unused++
			continue
		}
		unused = 0
		w.serveApart(sl.wrap(&primedConn{Conn: st, first: b[0], primed: true}))
	}
}

// maxUnusedSpares is how many spares in a row the edge may close unused
// before the agent opens no more on the session.
const maxUnusedSpares = 3

// primedConn is a stream whose first byte has been read already.
type primedConn struct {
	net.Conn
	first  byte
	primed bool // first is still to be read
}

func (c *primedConn) Read(p []byte) (int, error) {
	if c.primed && len(p) > 0 {
		p[0], c.primed = c.first, false
		return 1, nil
	}
	return c.Conn.Read(p)
}
