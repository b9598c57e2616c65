package limiter

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"unsafe"
)

// Tag returns what names key in Redis and in the store's listing: the
// key itself, or with HashKey its HMAC in hex.
func (s *redisCore) Tag(key string) string { return s.tag(key) }

// tag returns the part of the Redis keys that names the client: the key
// itself, or its HMAC in hex.
func (s *redisCore) tag(key string) string {
	if s.hashKey == nil {
		return key
	}
	m := hmac.New(sha256.New, s.hashKey)
	m.Write([]byte(key))
	return hex.EncodeToString(m.Sum(nil))
}

// base returns the Redis key of a client tag in the named limit without its
// last letter ("c" for the count, "r" for the refused tally). The tag is a
// Cluster hash tag, so both keys of a client map to one slot, and so do the
// keys of one client in every limit. A zone's first limit (name "") has no
// name in its keys.
func (s *redisCore) base(name, tag string) string { return s.keyOf(name, tag, "") }

// keyOf returns base(name, tag) followed by suffix ("c" for the count
// key), in one allocation.
func (s *redisCore) keyOf(name, tag, suffix string) string {
	b := s.appendBase(make([]byte, 0, baseLen(s.prefix, name, tag)+len(suffix)), name, tag)
	b = append(b, suffix...)
	return unsafe.String(unsafe.SliceData(b), len(b)) // b is not written again
}

// baseLen is the length of base(name, tag) with prefix.
func baseLen(prefix, name, tag string) int {
	n := len(prefix) + len(tag) + 3 // {tag}:
	if name != "" {
		n += len(name) + 2 // @name:
	}
	return n
}

// appendBase appends base(name, tag) to b.
func (s *redisCore) appendBase(b []byte, name, tag string) []byte {
	b = append(b, s.prefix...)
	if name != "" {
		b = append(b, '@')
		b = append(b, name...)
		b = append(b, ':')
	}
	b = append(b, '{')
	b = append(b, tag...)
	return append(b, "}:"...)
}

// parseKey splits a count key (…:c, or sync mode's …:g) or ban key the
// store wrote into the limit name and the tag; ok is false for a key of
// another zone whose name the prefix starts.
func (s *redisCore) parseKey(k string) (name, tag string, ok bool) {
	rest, ok := strings.CutPrefix(k, s.prefix)
	if !ok {
		return "", "", false
	}
	if after, isNamed := strings.CutPrefix(rest, "@"); isNamed {
		i := strings.Index(after, ":{")
		if i < 0 {
			return "", "", false
		}
		name, rest = after[:i], after[i+1:]
	}
	if !strings.HasPrefix(rest, "{") || !(strings.HasSuffix(rest, "}:c") || strings.HasSuffix(rest, "}:g") || strings.HasSuffix(rest, "}:b")) {
		return "", "", false
	}
	return name, rest[1 : len(rest)-3], true
}

// clusterSlot returns the Redis Cluster slot of key: CRC16 (XMODEM) of its
// hash tag, or of the whole key when it has none, modulo 16384.
func clusterSlot(key string) uint16 {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for k := 0; k < len(key); k++ {
		crc ^= uint16(key[k]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc % 16384
}

// isHexHash reports whether key looks like a hashed key: 64 hex digits.
func isHexHash(key string) bool {
	if len(key) != 2*sha256.Size {
		return false
	}
	_, err := hex.DecodeString(key)
	return err == nil
}
