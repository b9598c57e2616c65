//go:build !linux

package redistest

import "os/exec"

// dieWithParent does nothing outside Linux: servers are stopped by the
// test's cleanup.
func dieWithParent(*exec.Cmd) {}
