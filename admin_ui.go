package ratelimit

import (
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"net/http"
	"strings"
)

// The dashboard: one page, its style and script embedded in the binary and
// inlined into it, so it needs no CDN, no build step and no other route.
var (
	//go:embed ui/dashboard.html
	dashboardHTML string
	//go:embed ui/dashboard.css
	dashboardCSS string
	//go:embed ui/dashboard.js
	dashboardJS string
)

// dashboardZone is the path segment of the dashboard under /rate_limit/; no
// zone may take its name.
const dashboardZone = "ui"

// dashboardPage and dashboardCSP are the page and its Content-Security-Policy,
// built once: the policy admits exactly the inlined style and script (by
// their hashes) and requests to the page's own origin, so that even a key
// that slipped past the page's text rendering could run nothing.
var dashboardPage, dashboardCSP = buildDashboard()

// consolePage is the dashboard as the site handler (Console) serves it:
// the page at the console's base, its JSON API under api/.
var consolePage = []byte(strings.Replace(string(dashboardPage), `data-api="./"`, `data-api="./api/"`, 1))

func buildDashboard() ([]byte, string) {
	page := strings.Replace(dashboardHTML, "/*CSS*/", dashboardCSS, 1)
	page = strings.Replace(page, "/*JS*/", dashboardJS, 1)
	hash := func(s string) string {
		sum := sha256.Sum256([]byte(s))
		return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
	}
	csp := "default-src 'none'; style-src " + hash(dashboardCSS) + "; script-src " + hash(dashboardJS) +
		"; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
	return []byte(page), csp
}

// serveDashboard answers GET /rate_limit/ui with the dashboard page.
func serveDashboard(w http.ResponseWriter, r *http.Request) error {
	if _, err := parseQuery(r.URL.RawQuery); err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	return serveDashboardPage(w, r, dashboardPage)
}

// serveDashboardPage answers a GET with page, the dashboard as the admin
// endpoint or the console serves it.
func serveDashboardPage(w http.ResponseWriter, r *http.Request, page []byte) error {
	if err := allowMethod(w, r, http.MethodGet); err != nil {
		return err
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", dashboardCSP)
	h.Set("X-Frame-Options", "DENY") // Cache-Control and nosniff: keepPrivate
	// The page's requests to the admin API must carry a Referer of the
	// page's origin: Caddy's admin endpoint checks the origin of browser
	// requests and reads it from Referer when a GET carries no Origin.
	h.Set("Referrer-Policy", "same-origin")
	_, err := w.Write(page)
	return err
}
