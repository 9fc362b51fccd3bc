//go:build !unix

package agent

import (
	"errors"
	"os"
)

// lockFile is not available here: every run is a new instance.
func lockFile(*os.File) error { return errors.ErrUnsupported }
