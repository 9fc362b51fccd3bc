package agent_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// TestInspectorRefusedInBrowser: a webhook the edge refused (no
// signature) is listed in the inspector page, in a real Chromium, with
// its 403 and the edge's reason, and without Replay; the API refuses to
// replay it.
func TestInspectorRefusedInBrowser(t *testing.T) {
	chromium := tunneltest.Tool(t, "chromium")
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	cfg := e.AgentConfig("", tunneltest.StartBackend(t).Addr())
	cfg.Subdomain, cfg.VerifyWebhook, cfg.VerifyWebhookSecret = "hooks", "github", "It's a Secret to Everybody"
	st := tunneltest.StartAgent(t, cfg).WaitOnline(t)
	resp, err := e.Client().Post(tunneltest.URL("https", "hooks", "/payload"), "application/json", strings.NewReader(`{"zen":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || resp.Header.Get(mux.ErrorHeader) != mux.CodeWebhookUnverified {
		t.Fatalf("unsigned webhook: %d %s", resp.StatusCode, resp.Header.Get(mux.ErrorHeader))
	}
	var refused agent.Capture
	tunneltest.Eventually(t, 10*time.Second, "the refusal in the inspector's API", func() bool {
		list := tunneltest.Captures(t, st.InspectURL)
		if len(list) == 1 && list[0].Refused != "" {
			refused = list[0]
			return true
		}
		return false
	})
	if refused.Method != http.MethodPost || refused.Path != "/payload" || refused.Status != http.StatusForbidden || refused.Code != mux.CodeWebhookUnverified {
		t.Fatalf("the refusal's entry: %+v", refused)
	}
	replay, err := http.Post(fmt.Sprintf("%s/api/requests/%d/replay", st.InspectURL, refused.ID), "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	why, _ := io.ReadAll(replay.Body)
	replay.Body.Close()
	if replay.StatusCode != http.StatusConflict || !strings.Contains(string(why), "the edge refused") {
		t.Fatalf("replay of a refused request: %d %s, want 409 saying the edge refused it", replay.StatusCode, why)
	}

	ctx := tunneltest.Browser(t, chromium)
	sel := fmt.Sprintf(`#rows tr[data-id="%d"]`, refused.ID)
	if err := chromedp.Do(ctx, chromedp.Navigate(st.InspectURL), chromedp.WaitVisible(chromedp.CSS(sel)),
		chromedp.Click(chromedp.CSS(sel)), chromedp.WaitVisible(chromedp.ID("refused"))); err != nil {
		t.Fatalf("open the refused request: %v", err)
	}
	detail, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`[document.querySelector("#detail h2").textContent,
		document.getElementById("refused").textContent, String(document.querySelectorAll("#detail button").length)]`))
	if err != nil {
		t.Fatal(err)
	}
	if detail[0] != "POST /payload → 403 (webhook_unverified)" || detail[1] != "Refused at the edge: "+refused.Refused || detail[2] != "0" {
		t.Fatalf("the refused request's detail (title, reason, buttons): %q", detail)
	}
}
