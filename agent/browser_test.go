package agent_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestInspectorInBrowser loads the inspector's page in a real headless
// Chromium while requests go through a real tunnel: a row appears for
// each, with time, duration and size; the filter by path, status and
// method narrows them; JSON is pretty-printed, a form shown as fields, a
// binary body as its size and hex with a download link; a gRPC call's
// status shown by its name; visitors' HTML is shown as text, never run; a
// click on Replay makes a new row, and so does Edit and replay, whose
// edited body reaches the local service. A screenshot is kept
// (tunneltest.ArtifactDir). About 3 s.
func TestInspectorInBrowser(t *testing.T) {
	chromium := tunneltest.Tool(t, "chromium")
	var mu sync.Mutex
	var bodies []string
	local := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, r.URL.Path+" "+string(b))
		mu.Unlock()
		switch r.URL.Path {
		case "/missing":
			http.NotFound(w, r)
		case "/grpc.Svc/Call":
			// A gRPC server's answer of trailers only.
			w.Header().Set("Content-Type", "application/grpc")
			w.Header().Set("Grpc-Status", "5")
		case "/bin":
			w.Header().Set("Content-Type", "image/png")
			w.Write([]byte("\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00"))
		case "/hook":
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"ok":true,"items":[1,2]}`)
		default:
			io.WriteString(w, "hello")
		}
	}))
	t.Cleanup(local.Close)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", strings.TrimPrefix(local.URL, "http://"))
	cfg.Subdomain, cfg.InspectAddr = "page", "127.0.0.1:0"
	a := tunneltest.StartAgent(t, cfg)
	st := a.WaitOnline(t)

	c := e.Client()
	send := func(method, path, ctype, body string, hdr ...string) {
		t.Helper()
		req, _ := http.NewRequest(method, tunneltest.URL("https", "page", path), strings.NewReader(body))
		if ctype != "" {
			req.Header.Set("Content-Type", ctype)
		}
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	send("GET", "/hello", "", "", "X-Evil", `<img src=x onerror="document.title='pwned'">`)
	send("POST", "/hook", "application/json", `{"event":"paid","amount":42}`)
	send("POST", "/form", "application/x-www-form-urlencoded", "name=Ada+Lovelace&lang=en")
	send("GET", "/missing", "", "")
	send("POST", "/grpc.Svc/Call", "application/grpc", "\x00\x00\x00\x00\x00", "Te", "trailers")
	send("GET", "/bin", "", "")

	ctx := tunneltest.Browser(t, chromium)
	do := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, actions...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	text := func(css string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(css)))
		if err != nil {
			t.Fatalf("text of %s: %v", css, err)
		}
		return s
	}
	count := func(css string) int {
		t.Helper()
		n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll(`+strconv.Quote(css)+`).length`))
		if err != nil {
			t.Fatalf("count %s: %v", css, err)
		}
		return n
	}
	waitRows := func(want int, what string) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for count("#rows tr") != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d rows, want %d", what, count("#rows tr"), want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	do("load the page", chromedp.Navigate(st.InspectURL), chromedp.WaitVisible(chromedp.ID("rows")))
	waitRows(6, "the requests sent through the tunnel")
	listRedrawnOnlyOnChange(t, ctx)

	cells, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("#rows tr:first-child td")).map(td => td.textContent)`))
	if err != nil || len(cells) != 6 || cells[1] != "GET" || cells[2] != "/bin" || cells[3] != "200" || !strings.HasSuffix(cells[4], "s") || cells[5] != "20 B" ||
		!strings.Contains(cells[0], ":") {
		t.Errorf("newest row (time, method, path, status, duration, size): %q %v", cells, err)
	}

	setFilter := func(id, value string) {
		t.Helper()
		// As typing does: the value, then an input event.
		do("filter "+id, chromedp.Evaluate[chromedp.Void](`(e => { e.value = `+strconv.Quote(value)+`; e.dispatchEvent(new Event("input")) })(document.getElementById("`+id+`"))`))
	}
	setFilter("f-path", "hook")
	waitRows(1, "filtered by path hook")
	setFilter("f-path", "")
	setFilter("f-status", "4xx")
	waitRows(1, "filtered by status 4xx")
	setFilter("f-status", "200")
	waitRows(5, "filtered by status 200")
	setFilter("f-status", "")
	setFilter("f-method", "POST")
	waitRows(3, "filtered by method POST")
	setFilter("f-method", "")
	waitRows(6, "filters cleared")

	caps := map[string]agent.Capture{}
	for _, cp := range tunneltest.Captures(t, st.InspectURL) {
		caps[cp.Path] = cp
	}
	clickRow := func(path string) {
		t.Helper()
		// A row the page draws anew (a capture that changed) between
		// chromedp's query and its click is gone, as "Could not find
		// node"; a person's click lands on the row drawn in its place,
		// so the click is made again.
		sel := fmt.Sprintf(`#rows tr[data-id="%d"]`, caps[path].ID)
		deadline := time.Now().Add(15 * time.Second)
		for {
			err := chromedp.Do(ctx, chromedp.Click(chromedp.CSS(sel)), chromedp.WaitVisible(chromedp.ID("replay")))
			if err == nil {
				return
			}
			if !strings.Contains(err.Error(), "Could not find node") || time.Now().After(deadline) {
				t.Fatalf("open %s: %v", path, err)
			}
		}
	}
	clickRow("/hook")
	if s := text("#detail pre.json"); !strings.Contains(s, "{\n  \"event\": \"paid\",\n  \"amount\": 42\n}") {
		t.Errorf("request JSON not pretty-printed: %q", s)
	}
	clickRow("/form")
	if s := text("#detail table.form"); !strings.Contains(s, "name") || !strings.Contains(s, "Ada Lovelace") {
		t.Errorf("form not shown as fields: %q", s)
	}
	clickRow("/bin")
	href, err := chromedp.Run(ctx, chromedp.Evaluate[string](`Array.from(document.querySelectorAll("#detail a[download]")).pop().getAttribute("href")`))
	if s := text("#detail pre.hex"); err != nil || !strings.Contains(s, "89 50 4e 47") || !strings.Contains(s, ".PNG") || !strings.Contains(href, "/response/body") {
		t.Errorf("binary body: hex %q, download %q %v", s, href, err)
	}
	clickRow("/grpc.Svc/Call")
	row := fmt.Sprintf(`#rows tr[data-id="%d"] td:nth-child(4)`, caps["/grpc.Svc/Call"].ID)
	if cell, head := text(row), text("#detail h2"); cell != "200 grpc NOT_FOUND" || !strings.HasSuffix(head, "→ 200 · grpc-status 5 NOT_FOUND") {
		t.Errorf("a gRPC call's status: row %q, detail %q", cell, head)
	}
	clickRow("/hello")
	title, err := chromedp.Run(ctx, chromedp.Title())
	if s := text("#detail"); err != nil || !strings.Contains(s, `X-Evil: <img src=x onerror="document.title='pwned'">`) || count("#detail img") != 0 || title != "ngstone inspector" {
		t.Errorf("a visitor's HTML was not shown as text: title %q %v, %d img, detail %q", title, err, count("#detail img"), s)
	}

	clickRow("/hook")
	do("replay", chromedp.Click(chromedp.ID("replay")))
	waitRows(7, "the replay's row")
	if n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`Array.from(document.querySelectorAll("#rows tr td:nth-child(2)")).filter(td => td.textContent.startsWith("↻")).length`)); err != nil || n != 1 {
		t.Errorf("%d rows marked as a replay, want 1 (%v)", n, err)
	}
	clickRow("/hook")
	do("edit and replay", chromedp.Click(chromedp.ID("edit")), chromedp.WaitVisible(chromedp.ID("edit-body")),
		chromedp.Evaluate[chromedp.Void](`document.getElementById("edit-body").value = '{"event":"refunded"}'`), chromedp.Click(chromedp.ID("edit-send")))
	waitRows(8, "the edited replay's row")
	mu.Lock()
	last := bodies[len(bodies)-1]
	mu.Unlock()
	if last != `/hook {"event":"refunded"}` {
		t.Errorf("the local service got %q for the edited replay", last)
	}

	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(tunneltest.ArtifactDir(t), "inspector.png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s (%d bytes)", path, len(png))
}

// listRedrawnOnlyOnChange: the inspector's list, polled each second, is
// not drawn again while the agent's answer stays the same: two polls
// pass with no change to the rows.
func listRedrawnOnlyOnChange(t *testing.T, ctx context.Context) {
	t.Helper()
	if err := chromedp.Do(ctx, chromedp.Evaluate[chromedp.Void](`window.redraws = 0; window.polls = 0;
		new MutationObserver(() => window.redraws++).observe(document.getElementById("rows"), {childList: true});
		const f = window.fetch;
		window.fetch = (u, ...a) => { if (String(u).includes("/api/requests")) window.polls++; return f(u, ...a); };`)); err != nil {
		t.Fatalf("watch the list: %v", err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		// The third poll starts a second after the second, whose answer
		// has been handled by then.
		polls, err := chromedp.Run(ctx, chromedp.Evaluate[int](`window.polls`))
		if err != nil {
			t.Fatalf("polls: %v", err)
		}
		if polls >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d polls of the list in 15 s, want 3", polls)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n, err := chromedp.Run(ctx, chromedp.Evaluate[int](`window.redraws`)); err != nil || n != 0 {
		t.Errorf("the list was drawn %d times while nothing changed, want 0 (%v)", n, err)
	}
}
