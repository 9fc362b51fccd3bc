package tunneltest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// ArtifactDir is where a test keeps what a person looks at afterwards
// (screenshots, screen snapshots): NGSTONE_TEST_ARTIFACTS/TEST-NAME when
// that is set, else a directory removed with the test. The test logs it.
func ArtifactDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	if root := os.Getenv("NGSTONE_TEST_ARTIFACTS"); root != "" {
		dir = filepath.Join(root, strings.ReplaceAll(t.Name(), "/", "_"))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("artifacts in %s", dir)
	return dir
}

// Tool returns the path of a program a test drives (chromium, tmux). A
// test without it is skipped on a developer's machine and fails in CI
// (CI set), where .ci/run installs it.
func Tool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("%s is not installed: .ci/run installs it", name)
	}
	t.Skipf("%s is not installed (apt-get install %s)", name, name)
	return ""
}
