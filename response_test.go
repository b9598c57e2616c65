package ratelimit

import (
	"testing"
	"unsafe"
)

// The request's state is one allocation per request: within 256 bytes it
// takes a 240- or 256-byte block, past that 288.
func TestRequestStateSizeClass(t *testing.T) {
	if n := unsafe.Sizeof(requestState{}); n > 256 {
		t.Fatalf("requestState takes %d bytes, over the 256-byte size class", n)
	}
}
