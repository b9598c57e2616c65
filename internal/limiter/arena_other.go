//go:build race || !(linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package limiter

// mapArena allocates size bytes on the Go heap: on a platform whose build
// maps no memory itself, and under the race detector, which sees no access
// to memory mapped outside the heap (so the inline tables stay checked for
// races).
func mapArena(size int) mapping { return mapping{b: make([]byte, size)} }
