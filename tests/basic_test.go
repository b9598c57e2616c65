package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// Six quick requests with max 5: five 200s counting down, then a 429 with
// Retry-After.
func TestSixRequestsFiveAdmitted(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone six
		window 60
		max 5
	}
	respond "ok"
}`)
	before := time.Now().Unix()
	for i := 1; i <= 5; i++ {
		resp, body := s.get("/")
		wantStatus(t, resp, http.StatusOK)
		if body != "ok" {
			t.Errorf("request %d: body = %q, want ok", i, body)
		}
		wantHeader(t, resp, "X-RateLimit-Limit", "5")
		wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(5-i))
		reset, err := strconv.ParseInt(resp.Header.Get("X-RateLimit-Reset"), 10, 64)
		if err != nil || reset < before+59 || reset > time.Now().Unix()+61 {
			t.Errorf("request %d: X-RateLimit-Reset = %q, want about %d", i, resp.Header.Get("X-RateLimit-Reset"), before+60)
		}
		if ra := resp.Header.Get("Retry-After"); ra != "" {
			t.Errorf("request %d: Retry-After = %q on an admitted request", i, ra)
		}
	}
	resp, _ := s.get("/")
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Limit", "5")
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > 60 {
		t.Errorf("Retry-After = %q, want 1..60", resp.Header.Get("Retry-After"))
	}
}

// The quota headers are set before the next handler runs, so a 404 from a
// later handler carries them, whether it responds or returns an error.
func TestHeadersOnNotFound(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone notfound
		max 10
	}
	handle /files/* {
		root * `+t.TempDir()+`
		file_server
	}
	respond /gone "nope" 404
}`)
	resp, body := s.get("/gone")
	wantStatus(t, resp, http.StatusNotFound)
	if body != "nope" {
		t.Errorf("body = %q, want nope", body)
	}
	wantHeader(t, resp, "X-RateLimit-Limit", "10")
	wantHeader(t, resp, "X-RateLimit-Remaining", "9")

	resp, _ = s.get("/files/missing.txt")
	wantStatus(t, resp, http.StatusNotFound)
	wantHeader(t, resp, "X-RateLimit-Remaining", "8")
}

// handle_errors renders the 429 with the placeholders the handler sets.
func TestHandleErrorsJSONBody(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone jsonbody
		max 1
	}
	respond "ok"
	handle_errors 429 {
		header Content-Type application/json
		respond `+"`"+`{"error":"rate_limited","zone":"{http.rate_limit.zone}","key":"{http.rate_limit.key}","limit":{http.rate_limit.limit},"remaining":{http.rate_limit.remaining},"reset":{http.rate_limit.reset},"exceeded":{http.rate_limit.exceeded}}`+"`"+` 429
	}
}`)
	resp, _ := s.get("/")
	wantStatus(t, resp, http.StatusOK)
	resp, body := s.get("/")
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "Content-Type", "application/json")
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	if resp.Header.Get("Retry-After") == "" {
		t.Error("no Retry-After on the 429")
	}
	var got struct {
		Error     string `json:"error"`
		Zone      string `json:"zone"`
		Key       string `json:"key"`
		Limit     int    `json:"limit"`
		Remaining int    `json:"remaining"`
		Reset     int64  `json:"reset"`
		Exceeded  bool   `json:"exceeded"`
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("body %q is not JSON: %v", body, err)
	}
	if got.Error != "rate_limited" || got.Zone != "jsonbody" || got.Key != "127.0.0.1" || got.Limit != 1 ||
		got.Remaining != 0 || !got.Exceeded || strconv.FormatInt(got.Reset, 10) != resp.Header.Get("X-RateLimit-Reset") {
		t.Errorf("body = %+v", got)
	}
}

// A reload through the admin API keeps every count and applies a new max at
// once.
func TestReloadKeepsCounts(t *testing.T) {
	site := `
:$PORT {
	rate_limit {
		zone reload
		window %s
		max %d
	}
	respond "ok"
}`
	s := startCaddy(t, "", fmt.Sprintf(site, "1m", 5))
	for i := 1; i <= 3; i++ {
		resp, _ := s.get("/")
		wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(5-i))
	}
	s.reload("", fmt.Sprintf(site, "1m", 5))
	resp, _ := s.get("/")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Remaining", "1")

	// A new max applies to the counts already made: 4 used of 10.
	s.reload("", fmt.Sprintf(site, "2m", 10))
	resp, _ = s.get("/")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Limit", "10")
	wantHeader(t, resp, "X-RateLimit-Remaining", "5")

	// A lower max than the count refuses at once.
	s.reload("", fmt.Sprintf(site, "2m", 3))
	resp, _ = s.get("/")
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")

	// A shorter window applies to the running window at once.
	s.reload("", fmt.Sprintf(site, "5", 3))
	resp, _ = s.get("/")
	reset, err := strconv.ParseInt(resp.Header.Get("X-RateLimit-Reset"), 10, 64)
	if err != nil || reset > time.Now().Unix()+6 {
		t.Fatalf("X-RateLimit-Reset = %q after shortening the window to 5s, want within 5s", resp.Header.Get("X-RateLimit-Reset"))
	}
}

// clientIPSite limits the zone it is formatted with to 2 requests a minute
// and answers with the client IP Caddy resolved.
const clientIPSite = `
:$PORT {
	rate_limit {
		zone %s
		max 2
	}
	respond "{client_ip}"
}`

// With the peer trusted, X-Forwarded-For names the client; without, a spoofed
// X-Forwarded-For changes nothing.
func TestTrustedProxies(t *testing.T) {
	site := clientIPSite
	trusted := startCaddy(t, "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}", fmt.Sprintf(site, "trusted"))
	for _, ip := range []string{"203.0.113.1", "203.0.113.2", "203.0.113.3"} {
		for i := 1; i <= 2; i++ {
			resp, body := trusted.get("/", "X-Forwarded-For", ip)
			wantStatus(t, resp, http.StatusOK)
			if body != ip {
				t.Fatalf("client_ip = %q, want %q", body, ip)
			}
			wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(2-i))
		}
		resp, _ := trusted.get("/", "X-Forwarded-For", ip)
		wantStatus(t, resp, http.StatusTooManyRequests)
	}

	spoofed := startCaddy(t, "", fmt.Sprintf(site, "untrusted"))
	for i, ip := range []string{"198.51.100.1", "198.51.100.2", "198.51.100.3"} {
		resp, body := spoofed.get("/", "X-Forwarded-For", ip)
		if body != "127.0.0.1" && resp.StatusCode == http.StatusOK {
			t.Fatalf("client_ip = %q, want the peer 127.0.0.1", body)
		}
		want := http.StatusOK
		if i == 2 {
			want = http.StatusTooManyRequests
		}
		wantStatus(t, resp, want)
	}
}

// Two IPv6 addresses in one /64 share a count; another /64 has its own.
func TestIPv6Prefix(t *testing.T) {
	s := startCaddy(t, "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}", `
:$PORT {
	rate_limit {
		zone ipv6
		max 2
	}
	respond "ok"
}`)
	resp, _ := s.get("/", "X-Forwarded-For", "2001:db8:1:2::1")
	wantHeader(t, resp, "X-RateLimit-Remaining", "1")
	resp, _ = s.get("/", "X-Forwarded-For", "2001:db8:1:2:ffff:ffff:ffff:fffe")
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	resp, _ = s.get("/", "X-Forwarded-For", "2001:db8:1:2::3")
	wantStatus(t, resp, http.StatusTooManyRequests)
	resp, _ = s.get("/", "X-Forwarded-For", "2001:db8:1:3::1")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Remaining", "1")
}

// enabled false passes everything, uncounted and without headers.
func TestDisabled(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone disabled
		max 1
		enabled false
	}
	respond "ok"
}`)
	for range 5 {
		resp, body := s.get("/")
		wantStatus(t, resp, http.StatusOK)
		if body != "ok" {
			t.Fatalf("body = %q", body)
		}
		if h := resp.Header.Get("X-RateLimit-Limit"); h != "" {
			t.Fatalf("X-RateLimit-Limit = %q on a disabled handler", h)
		}
	}
}

// headers ietf sends the draft's RateLimit-Policy and RateLimit fields and
// no legacy ones; a custom key counts per key, falling back to the IP when
// it resolves empty.
func TestIETFHeadersAndCustomKey(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone ietf
		window 30
		max 2
		headers ietf
		key {http.request.header.X-API-Key}
	}
	respond "ok"
}`)
	resp, _ := s.get("/", "X-API-Key", "alice")
	wantHeader(t, resp, "RateLimit-Policy", `"ietf";q=2;w=30`)
	if got := resp.Header.Get("RateLimit"); got != `"ietf";r=1;t=30` && got != `"ietf";r=1;t=29` {
		t.Errorf("RateLimit = %q, want \"ietf\";r=1;t=30", got)
	}
	if h := resp.Header.Get("X-RateLimit-Limit"); h != "" {
		t.Errorf("X-RateLimit-Limit = %q with headers ietf", h)
	}
	s.get("/", "X-API-Key", "alice")
	resp, _ = s.get("/", "X-API-Key", "alice")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"ietf";r=0;t=`) {
		t.Errorf("RateLimit = %q on the 429", resp.Header.Get("RateLimit"))
	}
	resp, _ = s.get("/", "X-API-Key", "bob")
	wantStatus(t, resp, http.StatusOK)
	resp, _ = s.get("/") // no key: counted under the client IP
	wantStatus(t, resp, http.StatusOK)
	if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"ietf";r=1;`) {
		t.Errorf("RateLimit = %q for the IP fallback", resp.Header.Get("RateLimit"))
	}
}

// Bad settings fail the load, naming the option and the value, and the
// running config stays.
func TestLoadErrors(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone loaderr
		max 1
	}
	respond "ok"
}`)
	for _, tc := range []struct{ site, want string }{
		{`rate_limit {
		zone clash
		max 5
	}
	rate_limit /x {
		zone clash
		max 6
	}`, `zone \"clash\" is configured twice with different settings`},
		{`rate_limit {
		max_tracked 10
	}`, `invalid max_tracked \"10\": must be at least 1000`},
		{`rate_limit {
		window 1ms
	}`, `invalid window \"1ms\": must be at least 1s`},
	} {
		cfg := fmt.Sprintf(globals, adminPort, s.Port, freePort(), "") + fmt.Sprintf(":%d {\n\t%s\n\trespond \"new\"\n}\n", s.Port, tc.site)
		// The admin API returns the error inside a JSON string, quotes escaped.
		caddytest.AssertLoadError(t, cfg, "caddyfile", tc.want)
	}
	// Two servers naming one zone differently: a load error too, and the
	// failed load leaves the running zone's settings as they were.
	cfg := fmt.Sprintf(globals, adminPort, s.Port, freePort(), "") + fmt.Sprintf(`
:%d {
	rate_limit {
		zone loaderr
		max 7
	}
	respond "new"
}
:%d {
	rate_limit {
		zone loaderr
		max 8
	}
	respond "other"
}
`, s.Port, freePort())
	caddytest.AssertLoadError(t, cfg, "caddyfile", `zone \"loaderr\" is configured twice with different settings`)

	resp, body := s.get("/")
	if body != "ok" {
		t.Fatalf("body = %q after failed loads, want the old config's ok", body)
	}
	wantStatus(t, resp, http.StatusOK)
	var summary []struct {
		Name string `json:"name"`
		Max  int    `json:"max"`
	}
	adminJSON(t, "/rate_limit/", &summary)
	for _, z := range summary {
		if z.Name == "loaderr" && z.Max != 1 {
			t.Fatalf("zone loaderr has max %d after a failed reload, want the running config's 1", z.Max)
		}
	}
}
