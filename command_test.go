package ratelimit

import (
	"bytes"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// top prints any key so that the table stays a table: a key that could pass
// for layout (spaces, tabs), be wider or narrower than its bytes (CJK,
// emoji, zero-width and combining characters), reorder or recolour the line
// (bidi overrides, escapes) or read as quoted is shown quoted in ASCII, and
// every column starts where its header does.
func TestPrintKeysHostileKeys(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		key    string
		quoted bool
	}{
		{"IPv4", "203.0.113.7", false},
		{"IPv6 prefix", "2001:db8::/64", false},
		{"path-like custom key", "key:/../../../config/", false},
		{"quote inside", `key:a"b`, false},
		{"hashed", "key:sha256:0123456789abcdef0123456789abcdef", false},
		{"run of spaces", "key:a     b", true},
		{"imitates columns", "1.2.3.4   999   0", true},
		{"imitates a row", "1.2.3.4 api 5 2 0 1m0s yes", true},
		{"leading space", " 203.0.113.7", true},
		{"trailing space", "203.0.113.7 ", true},
		{"tab", "key:a\tb", true},
		{"newline", "key:a\n203.0.113.9", true},
		{"carriage return", "key:a\rb", true},
		{"CJK wide", "key:東京都庁", true},
		{"fullwidth", "key:ＡＢＣ１２３", true},
		{"emoji", "key:🔥🔥", true},
		{"emoji ZWJ sequence", "key:👩‍👩‍👧", true},
		{"bidi override", "key:\u202egnp.exe", true},
		{"zero-width space", "key:a\u200bb", true},
		{"byte order mark", "\ufeff203.0.113.7", true},
		{"combining accent", "key:e\u0301", true},
		{"terminal escape", "key:\x1b[31mred\x1b[0m", true},
		{"invalid UTF-8", "key:\xff\xfe", true},
		{"starts with a quote", `"203.0.113.7"`, true},
	}
	now := time.Unix(1_800_000_000, 0)
	list := KeyList{Zone: "api", Total: len(tests)}
	for _, tt := range tests {
		list.Keys = append(list.Keys, KeyInfo{Key: tt.key, Policy: "api", Count: 5, Refused: 2, Reset: now.Unix() + 60, Limited: true})
	}
	var out bytes.Buffer
	if err := printKeys(&out, list, SortCount, now); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != len(tests)+2 || lines[len(lines)-1] != "24 of 24 keys in zone api" {
		t.Fatalf("printed %d lines, want a header, %d rows and the count:\n%s", len(lines), len(tests), out.String())
	}
	header := lines[0]
	var cols []int // where each column after KEY starts
	for _, name := range []string{"POLICY", "COUNT", "REFUSED", "REMAINING", "RESETS IN", "LIMITED"} {
		cols = append(cols, strings.Index(header, name))
	}
	for i, tt := range tests {
		row := lines[i+1]
		t.Run(tt.name, func(t *testing.T) {
			// Printable ASCII only: one column per byte, nothing that
			// moves the cursor.
			if j := strings.IndexFunc(row, func(r rune) bool { return r < ' ' || r > '~' }); j >= 0 {
				t.Fatalf("row %q has %q at byte %d: not one column per byte", row, row[j:j+1], j)
			}
			for c, at := range cols {
				if len(row) <= at || row[at-1] != ' ' || row[at] == ' ' {
					t.Errorf("row %q: column %d does not start at %d, under its header", row, c+2, at)
				}
			}
			if got, want := strings.Fields(row[cols[0]:]), []string{"api", "5", "2", "0", "1m", "yes"}; !slices.Equal(got, want) {
				t.Errorf("row %q: columns after the key are %q, want %q", row, got, want)
			}
			cell := strings.TrimRight(row[:cols[0]], " ")
			if !tt.quoted {
				if cell != tt.key {
					t.Errorf("key %q shown as %s, want it as it is", tt.key, cell)
				}
				return
			}
			if unq, err := strconv.Unquote(cell); !strings.HasPrefix(cell, `"`) || err != nil || unq != tt.key {
				t.Errorf("key %q shown as %s, want it quoted, unquoting to the key", tt.key, cell)
			}
		})
	}
}

// The KEYS column of caddy rate-limit zones shows a Redis zone's count with
// its age when it is not fresh, and a partial count as a lower bound, never
// as a bare number.
func TestTrackedText(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		zone ZoneInfo
		want string
	}{
		{ZoneInfo{TrackedKeys: 3}, "3"},
		{ZoneInfo{TrackedKeys: 462660, TrackedKeysAgeSeconds: 12}, "462660 (12s ago)"},
		{ZoneInfo{TrackedKeys: 0, TrackedKeysPartial: true}, ">=0"},
		{ZoneInfo{TrackedKeys: 120500, TrackedKeysPartial: true}, ">=120500"},
	} {
		if got := trackedText(tc.zone); got != tc.want {
			t.Errorf("trackedText(%+v) = %q, want %q", tc.zone, got, tc.want)
		}
	}
}

// Durations print as people write them, in the CLI's tables.
func TestHumanDuration(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "0s"},
		{0, "0s"},
		{999 * time.Millisecond, "0s"},
		{time.Second, "1s"},
		{time.Minute, "1m"},
		{90 * time.Second, "1m30s"},
		{15 * time.Minute, "15m"},
		{time.Hour + 30*time.Minute, "1h30m"},
		{time.Hour + time.Second, "1h1s"},
		{24 * time.Hour, "24h"},
	} {
		if got := humanDuration(tt.d); got != tt.want {
			t.Errorf("humanDuration(%v) = %q, want %q", tt.d, got, tt.want)
		}
	}
}

// top shows each key's requests in flight in a column of its own, only when
// a listed key has some.
func TestPrintKeysInFlight(t *testing.T) {
	now := time.Unix(1796000000, 0)
	list := KeyList{Zone: "api", Total: 2, Keys: []KeyInfo{
		{Key: "key:a", Policy: "api", Count: 5, Remaining: 95, Reset: now.Unix() + 30, InFlight: 3},
		{Key: "key:b", Policy: "api", Count: 1, Remaining: 99, Reset: now.Unix() + 30},
	}}
	var out strings.Builder
	if err := printKeys(&out, list, SortCount, now); err != nil {
		t.Fatal(err)
	}
	want := `KEY    POLICY  COUNT  REFUSED  REMAINING  RESETS IN  LIMITED  IN FLIGHT
key:a  api     5      0        95         30s        no       3
key:b  api     1      0        99         30s        no       0
2 of 2 keys in zone api
`
	if out.String() != want {
		t.Errorf("printed\n%s\nwant\n%s", out.String(), want)
	}
	list.Keys[0].InFlight = 0
	out.Reset()
	_ = printKeys(&out, list, SortCount, now)
	if strings.Contains(out.String(), "IN FLIGHT") {
		t.Errorf("a column for requests in flight without any:\n%s", out.String())
	}
}
