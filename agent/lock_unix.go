//go:build unix

package agent

import (
	"errors"
	"os"
	"syscall"
)

// lockFile takes an exclusive lock on f without waiting; errLocked if
// another process holds it. The kernel drops it when f is closed or the
// process ends, however it ends.
func lockFile(f *os.File) error {
	err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return errLocked
	}
	return err
}
