package agent

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/mux"
)

// TestUnreadBodyOnStream: the agent answers 401 itself (basic auth)
// without reading the body, on a raw stream; a head that keeps the stream
// must carry the next request, framed as sent; one that closes it must be
// followed by the stream's end.
func TestUnreadBodyOnStream(t *testing.T) {
	local := echoLocal(t)
	cfg := Config{}
	cfg.Tunnel.BasicAuth = []string{"alice:correct horse"}
	a := relayAgentWith(t, local, cfg, nil)
	const auth = "Authorization: Basic YWxpY2U6Y29ycmVjdCBob3JzZQ==\r\n"
	line := "GET /smuggled HTTP/1.1\r\nHost: app.ngstone.test\r\n" + auth + "\r\n"
	for _, size := range []int{10, mux.KeptUnread - 1, mux.KeptUnread, mux.KeptUnread + 1, 200 << 10, 256 << 10, 256<<10 + 1, 1 << 20} {
		for _, chunked := range []bool{false, true} {
			for _, extra := range []string{"", "Content-Type: application/grpc\r\n", "Expect: 100-continue\r\n"} {
				for _, method := range []string{"POST", "HEAD"} {
					name := fmt.Sprintf("%s %d chunked=%v %q", method, size, chunked, extra)
					x := open(t, a)
					x.c.SetDeadline(time.Now().Add(10 * time.Second))
					body := strings.Repeat(line, size/len(line)+1)[:size]
					head := method + " /echo HTTP/1.1\r\nHost: app.ngstone.test\r\n" + extra
					if chunked {
						head += "Transfer-Encoding: chunked\r\n\r\n"
						body = fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(body), body)
					} else {
						head += fmt.Sprintf("Content-Length: %d\r\n\r\n", size)
					}
					wrote := make(chan error, 1)
					go func() { _, err := io.WriteString(x.c, head+body); wrote <- err }()
					var resp *http.Response
					var err error
					for {
						resp, err = http.ReadResponse(x.br, &http.Request{Method: method})
						if err != nil || resp.StatusCode >= 200 {
							break
						}
					}
					if err != nil {
						t.Errorf("%s: %v", name, err)
						continue
					}
					io.Copy(io.Discard, resp.Body)
					if resp.StatusCode != http.StatusUnauthorized {
						t.Errorf("%s: %d", name, resp.StatusCode)
					}
					wantClose := chunked || size > mux.KeptUnread || strings.HasPrefix(extra, "Expect") // net/http closes an unread 100-continue itself
					if resp.Close != wantClose {
						t.Errorf("%s: close %v, want %v", name, resp.Close, wantClose)
					}
					if resp.Close {
						x.c.SetReadDeadline(time.Now().Add(3 * time.Second))
						if rest, err := io.ReadAll(x.br); len(rest) > 0 || err != nil && !strings.Contains(err.Error(), "reset") {
							t.Errorf("%s: after close: %q %v", name, rest, err)
						}
						continue
					}
					if err := <-wrote; err != nil {
						t.Errorf("%s: kept, body write: %v", name, err)
						continue
					}
					io.WriteString(x.c, "POST /echo HTTP/1.1\r\nHost: app.ngstone.test\r\n"+auth+"Content-Length: 6\r\n\r\nsecond")
					resp, err = http.ReadResponse(x.br, nil)
					if err != nil {
						t.Errorf("%s: kept, next: %v", name, err)
						continue
					}
					var seen struct{ URI, Body string }
					err = json.NewDecoder(resp.Body).Decode(&seen)
					resp.Body.Close()
					if err != nil || seen.URI != "/echo" || seen.Body != "second" {
						t.Errorf("%s: kept, next seen as %+v %v", name, seen, err)
					}
				}
			}
		}
	}
}
