package edge_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// smugglingBody is n bytes of request heads: a body that a server which
// lost its place would parse as requests for /smuggled.
func smugglingBody(n int) []byte {
	const line = "GET /smuggled HTTP/1.1\r\nHost: unread." + tunneltest.Domain + "\r\n\r\n"
	return []byte(strings.Repeat(line, n/len(line)+1)[:n])
}

// TestRefusedUploadNotReadAsRequest: an HTTP/1.1 visitor's upload that a
// webhook tunnel refuses unread (past its largest body), typed gRPC or not,
// gets its 403, and the rest of its body is never read as a request: one
// for another tunnel, placed inside the body, is not served.
func TestRefusedUploadNotReadAsRequest(t *testing.T) {
	cfg := tunneltest.EdgeConfig(t)
	cfg.VerifyWebhookMaxBody = 64 << 10
	e := tunneltest.StartEdge(t, cfg)
	b := tunneltest.StartBackend(t)
	ac := e.AgentConfig("", b.Addr())
	ac.Subdomain, ac.VerifyWebhook, ac.VerifyWebhookSecret = "hook", "github", "s3cret-s3cret-s3cret"
	tunneltest.StartAgent(t, ac).WaitOnline(t)
	vc := e.AgentConfig("", b.Addr())
	vc.Subdomain = "victim"
	tunneltest.StartAgent(t, vc).WaitOnline(t)
	host := "hook." + tunneltest.Domain
	for _, size := range []int{10, 1 << 20} {
		for _, ct := range []string{"application/octet-stream", "application/grpc"} {
			name := fmt.Sprintf("%s %d", ct, size)
			conn, err := net.Dial("tcp", e.Addr("http").String())
			if err != nil {
				t.Fatal(err)
			}
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			br := bufio.NewReader(conn)
			go func() {
				fmt.Fprintf(conn, "POST /echo HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n", host, ct, size)
				body := smugglingBody(size)
				if size > 65537 {
					copy(body, strings.Repeat("x", 65537))
					copy(body[65537:], "GET /hello?smuggled HTTP/1.1\r\nHost: victim."+tunneltest.Domain+"\r\nConnection: close\r\n\r\n")
				}
				conn.Write(body)
			}()
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				conn.Close()
				continue
			}
			io.Copy(io.Discard, resp.Body)
			t.Logf("%s: %d close %v %s=%q", name, resp.StatusCode, resp.Close, mux.ErrorHeader, resp.Header.Get(mux.ErrorHeader))
			if resp.StatusCode != http.StatusForbidden {
				t.Errorf("%s: status %d, want 403", name, resp.StatusCode)
			}
			if !resp.Close {
				io.WriteString(conn, "GET /hello HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
				if resp2, err := http.ReadResponse(br, nil); err != nil {
					t.Errorf("%s: said keep-alive; next request: %v", name, err)
				} else {
					b2, _ := io.ReadAll(resp2.Body)
					resp2.Body.Close()
					t.Logf("%s: next %d %v %q", name, resp2.StatusCode, resp2.Header, b2)
					if string(b2) == "hello" {
						t.Errorf("%s: the request inside the body was served: smuggled", name)
					}
				}
			}
			conn.Close()
		}
	}
}
