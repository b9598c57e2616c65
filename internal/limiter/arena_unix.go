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
// the Go heap; it reports whether the memory is mapped.
func mapArena(size int) ([]byte, bool) {
	b, err := mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return make([]byte, size), false
	}
	return b, true
}

// unmapArena unmaps memory mapArena mapped.
func unmapArena(b []byte) { _ = munmap(b) }
