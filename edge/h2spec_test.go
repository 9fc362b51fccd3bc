package edge_test

import (
	"encoding/xml"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestH2Spec runs h2spec, the HTTP/2 conformance suite, against the edge's
// HTTPS listener and against a bare net/http server of the same Go: the
// edge shakes hands over TLS itself, and must not serve HTTP/2 any worse
// than net/http does. It runs where NGSTONE_H2SPEC names the h2spec binary
// (.ci/run builds it).
func TestH2Spec(t *testing.T) {
	bin := os.Getenv("NGSTONE_H2SPEC")
	if bin == "" {
		t.Skip("NGSTONE_H2SPEC names no h2spec binary (.ci/run builds one)")
	}
	bare := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) }))
	bare.EnableHTTP2 = true
	bare.Config.ErrorLog = log.New(io.Discard, "", 0)
	bare.StartTLS()
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	defer func() {
		// net/http's HTTP/2 server lets a connection that got a GOAWAY
		// live on for a second after its server closed.
		bare.Close()
		e.Close()
		tunneltest.Eventually(t, 10*time.Second, "HTTP/2 connections gone", func() bool {
			buf := make([]byte, 4<<20)
			return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "http2serverConn).serve(")
		})
	}()

	want := h2spec(t, bin, bare.Listener.Addr().String())
	got := h2spec(t, bin, e.Addr("https").String())
	t.Logf("h2spec: the edge fails %d of %d cases, net/http %d: %q", len(got.failed), got.cases, len(want.failed), got.failed)
	if got.cases != want.cases {
		t.Fatalf("h2spec ran %d cases against the edge, %d against net/http", got.cases, want.cases)
	}
	// A few cases race the server's answer to their request (a frame on a
	// stream the server has already closed): a case on which the two
	// differ is run again, alone, and counts only if it differs each time.
	for _, c := range symmetricDifference(got.failed, want.failed) {
		for range 3 {
			e1, b1 := h2specFails(t, bin, e.Addr("https").String(), c), h2specFails(t, bin, bare.Listener.Addr().String(), c)
			if e1 == b1 {
				c = ""
				break
			}
		}
		if c != "" {
			t.Errorf("h2spec %s: the edge and net/http differ, each time", c)
		}
	}
}

func symmetricDifference(a, b []string) []string {
	var out []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, x)
		}
	}
	for _, x := range b {
		if !slices.Contains(a, x) {
			out = append(out, x)
		}
	}
	return out
}

// h2specFails runs one case (its section, then its name) against addr.
func h2specFails(t *testing.T, bin, addr, c string) bool {
	section, name, _ := strings.Cut(c, " ")
	r := h2spec(t, bin, addr, section)
	return slices.Contains(r.failed, section+" "+name)
}

type h2specResult struct {
	cases  int
	failed []string // package and case name, sorted
}

// h2spec runs the suite (or the given sections) against addr over TLS and
// reads its JUnit report.
func h2spec(t *testing.T, bin, addr string, sections ...string) h2specResult {
	t.Helper()
	host, port, _ := net.SplitHostPort(addr)
	report := filepath.Join(t.TempDir(), "h2spec.xml")
	args := append(sections, "-t", "-k", "-h", host, "-p", port, "-j", report)
	out, _ := exec.Command(bin, args...).CombinedOutput()
	b, err := os.ReadFile(report)
	if err != nil {
		t.Fatalf("h2spec wrote no report: %v\n%s", err, out)
	}
	var doc struct {
		Suites []struct {
			Cases []struct {
				Package string    `xml:"package,attr"`
				Name    string    `xml:"classname,attr"`
				Failure *struct{} `xml:"failure"`
				Error   *struct{} `xml:"error"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	var r h2specResult
	for _, s := range doc.Suites {
		for _, c := range s.Cases {
			r.cases++
			if c.Failure != nil || c.Error != nil {
				r.failed = append(r.failed, fmt.Sprintf("%s %s", c.Package, c.Name))
			}
		}
	}
	slices.Sort(r.failed)
	return r
}
