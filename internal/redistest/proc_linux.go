package redistest

import (
	"os"
	"os/exec"
	"syscall"
)

// dieWithParent makes a server die with the test process, so that a test
// binary killed mid-run leaves no redis-server behind.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// signal freezes (SIGSTOP) or thaws (SIGCONT) a process.
func signal(p *os.Process, stop bool) error {
	if stop {
		return p.Signal(syscall.SIGSTOP)
	}
	return p.Signal(syscall.SIGCONT)
}
