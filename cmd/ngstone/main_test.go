package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/ngstone/ngstone/internal/etcdtest"
)

// ngstoneBin is the ngstone binary built once for the tests that run real
// processes.
var ngstoneBin string

// The version and commit stamped into ngstoneBin.
const (
	testVersion = "v0.0.0-test"
	testCommit  = "0123abcd"
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "ngstone-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ngstoneBin = filepath.Join(dir, "ngstone")
	// The build keeps using the user's build cache, which moves with
	// XDG_CACHE_HOME (set below) unless GOCACHE says where it is.
	gocache, err := exec.Command("go", "env", "GOCACHE").Output()
	if err != nil {
		fmt.Fprintln(os.Stderr, "go env GOCACHE:", err)
		os.Exit(1)
	}
	// The agents the tests start keep their instance ids (and the embedded
	// edge its CA) in a cache of the tests' own, not the user's.
	os.Setenv("XDG_CACHE_HOME", filepath.Join(dir, "cache"))
	// Nor do they read the user's settings file (ngstone config's).
	os.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	// Built as the Dockerfile builds it: static, trimmed, version stamped.
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-X main.version="+testVersion+" -X main.commit="+testCommit, "-o", ngstoneBin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOCACHE="+strings.TrimSpace(string(gocache)))
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build ngstone:", err)
		os.Exit(1)
	}
	code := m.Run()
	etcdtest.Stop()
	os.RemoveAll(dir)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}
