//go:build !(linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package limiter

// mapArena allocates size bytes on the Go heap: this platform's build maps
// no memory itself.
func mapArena(size int) ([]byte, bool) { return make([]byte, size), false }

// unmapArena is never called here: no arena is mapped.
func unmapArena([]byte) {}
