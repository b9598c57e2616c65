package limiter

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"github.com/redis/go-redis/v9"
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

// parseKey splits a count key (…:c, or sync mode's field …:g) or ban key the
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

// windowKey returns the name of sync mode's hash of the counts of the
// windows that end at end and last length (both Unix ms; redis_sync.lua):
// <prefix>w:{<tag>}:<end>:<length>, whose hash tag tag puts it in the slot
// of the keys it counts on a Cluster (slotTag). No client's keys start
// with "w:" after the prefix (theirs start with "{" or "@").
func (s *redisCore) windowKey(tag string, end, length int64) string {
	b := make([]byte, 0, len(s.prefix)+len(tag)+32)
	b = append(b, s.prefix...)
	b = append(b, "w:{"...)
	b = append(b, tag...)
	b = append(b, "}:"...)
	b = strconv.AppendInt(b, end, 10)
	b = append(b, ':')
	b = strconv.AppendInt(b, length, 10)
	return unsafe.String(unsafe.SliceData(b), len(b)) // b is not written again
}

// parseWindowKey returns the hash tag, end and length a window hash's name
// (windowKey) holds; ok is false for any other key.
func (s *redisCore) parseWindowKey(k string) (tag string, end, length int64, ok bool) {
	rest, ok := strings.CutPrefix(k, s.prefix+"w:{")
	if !ok {
		return "", 0, 0, false
	}
	tag, rest, ok = strings.Cut(rest, "}:")
	if !ok {
		return "", 0, 0, false
	}
	e, l, ok := strings.Cut(rest, ":")
	if !ok {
		return "", 0, 0, false
	}
	end, err1 := strconv.ParseInt(e, 10, 64)
	length, err2 := strconv.ParseInt(l, 10, 64)
	return tag, end, length, err1 == nil && err2 == nil && length > 0
}

// windowTag returns the hash tag of the window hashes that count key (a
// client's field, …:g): on a Cluster one whose slot is key's (slotTags), so
// that a batch of one slot's keys is one script call; else one tag for
// every key, so that a batch's keys of one window share one hash.
func (s *redisCore) windowTag(key string) string {
	if _, cluster := s.client.(*redis.ClusterClient); cluster {
		return slotTags()[clusterSlot(key)]
	}
	return "0"
}

// slotTags returns, for each Cluster slot, a short hash tag in it: the
// first base-36 number whose CRC16 falls in the slot.
var slotTags = sync.OnceValue(func() *[16384]string {
	var tags [16384]string
	for i, left := int64(0), len(tags); left > 0; i++ {
		t := strconv.FormatInt(i, 36)
		if slot := clusterSlot(t); tags[slot] == "" {
			tags[slot] = t
			left--
		}
	}
	return &tags
})
