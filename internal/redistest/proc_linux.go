package redistest

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes a server die with the test process, so that a test
// binary killed mid-run leaves no redis-server behind.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
