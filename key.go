package ratelimit

import (
	"crypto/sha256"
	"encoding/hex"
	"net/netip"
	"strings"
	"unicode"
	"unicode/utf8"
)

// customKeyPrefix starts every key that comes from the key placeholder, so
// that no client can send a value that lands in another client's IP counter.
const customKeyPrefix = "key:"

// missingKeyPrefix starts the key of a limit's missing value: a key space
// of its own, which no client's key can reach (theirs start with "key:").
const missingKeyPrefix = "missing:"

// hashedKeyPrefix starts the hash that stands for a custom key that is not
// kept as it is.
const hashedKeyPrefix = "sha256:"

// maxCustomKeyLen is the longest custom key kept as it is; a longer one is
// kept as its hash, so that keys a client chooses cannot grow the store past
// max_tracked times a small size.
const maxCustomKeyLen = 128

// customKey turns the resolved key placeholder into the key it is counted
// under. A key is client-chosen text that travels to logs, the admin API,
// Redis and a browser, so only a short key of printable characters is kept
// as it is; any other (too long, invalid UTF-8, control or format
// characters such as a newline or a bidi override) is kept as its hash, a
// form the listing shows exactly and an unblock can name. Distinct keys keep
// distinct counters either way.
func customKey(k string) string {
	// A key that reads as a hash is hashed too, so that no client can name
	// the counter of a client whose key was hashed.
	if len(k) > maxCustomKeyLen || !printable(k) || strings.HasPrefix(k, hashedKeyPrefix) {
		sum := sha256.Sum256([]byte(k))
		return customKeyPrefix + hashedKeyPrefix + hex.EncodeToString(sum[:16])
	}
	return customKeyPrefix + k
}

// printable reports whether s is valid UTF-8 made only of printable
// characters and the ASCII space (unicode.IsPrint).
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= utf8.RuneSelf {
			return printableRunes(s[i:])
		} else if c < ' ' || c == 0x7f {
			return false
		}
	}
	return true
}

// printableRunes is printable for text past the ASCII prefix.
func printableRunes(s string) bool {
	for _, r := range s {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return false // RuneError: invalid UTF-8, or a literal U+FFFD that would read as one
		}
	}
	return true
}

// clientIPKey turns a client address into the key it is counted under:
// an IPv4 address as it is, an IPv4-mapped IPv6 address as its IPv4 form, and
// an IPv6 address as its prefix of the given length ("2001:db8::/64"), so one
// client cannot dodge its limit by hopping through the addresses of its own
// network. Anything that is not an IP address (a Unix socket peer) is used
// unchanged.
func clientIPKey(ip string, ipv6Prefix int) string {
	if strings.IndexByte(ip, ':') < 0 {
		// IPv4, or no IP address at all (IPv6 has colons): either way
		// the key is ip as it is, and the common case skips the parse.
		return ip
	}
	addr, err := netip.ParseAddr(ip)
	if err != nil {
		return ip
	}
	if addr.Is4() {
		return ip
	}
	if addr.Is4In6() {
		return addr.Unmap().String()
	}
	addr = addr.WithZone("")
	if ipv6Prefix >= MaxIPv6Prefix {
		return addr.String()
	}
	p, err := addr.Prefix(ipv6Prefix)
	if err != nil {
		return addr.String()
	}
	return p.String()
}

// ipKey returns the key of client IP ip, or "" if there is none.
func (rl *RateLimit) ipKey(ip string) string {
	if ip == "" {
		return ""
	}
	return clientIPKey(ip, rl.IPv6Prefix)
}
