package ratelimit

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// The Caddyfile syntax block in UnmarshalCaddyfile's doc comment and the one
// in docs/configuration.md are identical, so the docs never drift from the
// parser's.
func TestDocsSyntaxBlock(t *testing.T) {
	src, err := os.ReadFile("caddyfile.go")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`Syntax:\n//\n((?://\t.*\n)+)`).FindSubmatch(src)
	if m == nil {
		t.Fatal("no syntax block in UnmarshalCaddyfile's doc comment")
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSuffix(string(m[1]), "\n"), "\n") {
		lines = append(lines, strings.TrimPrefix(l, "//\t"))
	}
	block := "```\n" + strings.Join(lines, "\n") + "\n```"
	if !strings.Contains(string(doc), block) {
		t.Errorf("docs/configuration.md lacks the syntax block of UnmarshalCaddyfile's doc comment:\n%s", block)
	}
}
