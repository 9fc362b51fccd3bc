package tunneltest

import (
	"context"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// Browser starts headless Chromium (the path Tool found) for the test: as
// root, without its sandbox, with an empty profile and none of its own
// network traffic; opts add to its flags. It is killed when the test ends.
func Browser(t testing.TB, path string, opts ...chromedp.ExecAllocatorOption) context.Context {
	t.Helper()
	opts = append([]chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1400, 900),
	}, opts...)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	tctx, cancelT := context.WithTimeout(ctx, 60*time.Second)
	t.Cleanup(func() {
		cancelT()
		cancel()
		cancelAlloc() // kills the browser and waits for it
	})
	return tctx
}
