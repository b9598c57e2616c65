//go:build !race && (linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package limiter

import "syscall"

// mmap and munmap are syscall.Mmap and syscall.Munmap; a test makes the
// mapping fail.
var (
	mmap   = syscall.Mmap
	munmap = syscall.Munmap
)

// mapArena maps size bytes of zeroed anonymous memory, or falls back to
// the Go heap. The mapping unmaps through the munmap of the moment it
// mapped, so that an arena mapped before a test swapped munmap is never
// unmapped through the test's.
func mapArena(size int) mapping {
	b, err := mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return mapping{b: make([]byte, size)}
	}
	return mapping{b, munmap}
}
