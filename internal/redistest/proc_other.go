//go:build !linux

package redistest

import (
	"errors"
	"os"
	"os/exec"
)

// dieWithParent does nothing outside Linux: servers are stopped by the
// test's cleanup.
func dieWithParent(*exec.Cmd) {}

// signal cannot freeze a process outside Linux here.
func signal(*os.Process, bool) error {
	return errors.New("pausing a process is supported on linux only")
}
