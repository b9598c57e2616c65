package ratelimit

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(Console{})
	httpcaddyfile.RegisterHandlerDirective("rate_limit_console", parseConsoleCaddyfile)
	// Where Caddy's own metrics handler, the model for serving admin data
	// in a site, runs: after basic_auth and the other middleware.
	httpcaddyfile.RegisterDirectiveOrder("rate_limit_console", httpcaddyfile.After, "metrics")
}

// Console serves the rate limiter's dashboard and its JSON API in a site,
// module http.handlers.rate_limit_console, as Caddy's metrics handler
// serves metrics: behind the site's own authentication, at a path a browser
// opens directly. It takes its base from the request (a handler does not
// see its matcher): for a request to <base>api/... it is everything before
// "api/", for the page the path itself, which must end with a slash (the
// page redirects there otherwise, so that its relative URLs resolve).
//
//	GET    <base>                  the dashboard
//	GET    <base>api/              every zone with its settings and totals
//	GET    <base>api/<zone>        the zone's tracked keys (the admin API's query)
//	DELETE <base>api/<zone>?key=   forget a key at once (an unblock)
//	GET, PUT, DELETE <base>api/<zone>/overrides  the zone's overrides
//
// The replies are the admin API's (admin.api.rate_limit). A site's cookies
// and basic-auth credentials ride along with any request a browser sends,
// so an unsafe request (any method but GET, HEAD and OPTIONS) that says it
// is cross-site (Sec-Fetch-Site other than same-origin or none, or an Origin
// whose scheme, host or port is not the request's) is refused with 403.
//
// A Console is safe for concurrent use.
type Console struct {
	// ReadOnly turns the unblock and overrides off: any method but GET is
	// refused with 403, and the dashboard's buttons fail with that error.
	// Default: false.
	ReadOnly bool `json:"read_only,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (Console) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit_console",
		New: func() caddy.Module { return new(Console) },
	}
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rate_limit_console [<matcher>] {
//		read_only   # no unblock
//	}
func (c *Console) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive's name
	if d.NextArg() {
		return d.Errf("rate_limit_console takes no arguments, got %q (a path goes before it as a matcher: rate_limit_console /rate-limits*)", d.Val())
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "read_only":
			if d.NextArg() {
				return d.Errf("read_only takes no arguments, got %q", d.Val())
			}
			c.ReadOnly = true
		default:
			return d.Errf("unrecognized rate_limit_console subdirective %q", d.Val())
		}
	}
	return nil
}

// parseConsoleCaddyfile sets up the console from Caddyfile tokens.
func parseConsoleCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	c := new(Console)
	err := c.UnmarshalCaddyfile(h.Dispenser)
	return c, err
}

// consoleAPI is the path segment of the JSON API under the console's base.
const consoleAPI = "api/"

// ServeHTTP serves the page or the JSON API. It never calls next: the
// console answers every request its matcher gives it.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	keepPrivate(w.Header())
	if crossSite(r) {
		return writeConsoleError(w, caddy.APIError{HTTPStatus: http.StatusForbidden,
			Err: errors.New("cross-site request refused: the console answers unsafe requests from its own site only")})
	}
	path := r.URL.EscapedPath()
	i := strings.LastIndex(path, "/"+consoleAPI)
	if i < 0 {
		return c.servePage(w, r)
	}
	rest := path[i+1+len(consoleAPI):]
	zone, overrides := zoneOverridesPath(rest)
	if !overrides {
		zone = rest
	}
	if strings.Contains(zone, "/") {
		return c.servePage(w, r)
	}
	var err error
	switch {
	case rest == "":
		err = allowMethod(w, r, http.MethodGet)
		if err == nil {
			if _, err = parseQuery(r.URL.RawQuery); err != nil {
				err = apiError(http.StatusBadRequest, err)
			} else {
				err = writeJSON(w, listZones(r.Context()))
			}
		}
	case r.Method != http.MethodGet && c.ReadOnly:
		err = apiError(http.StatusForbidden, errors.New("this console is read_only: unblock and set overrides through the admin API"))
	default:
		var name string
		if name, err = url.PathUnescape(zone); err == nil && overrides {
			err = serveOverrides(w, r, name)
		} else if err == nil {
			err = serveZone(w, r, name)
		} else {
			err = apiError(http.StatusBadRequest, errors.New("invalid zone in path "+strings.ToValidUTF8(path, "?")))
		}
	}
	if err != nil {
		return writeConsoleError(w, err)
	}
	return nil
}

// servePage answers a request for the page. The page's URLs are relative
// to it, so a path without its final slash (as the user typed it, before
// any handle_path stripped a prefix) is redirected to the one with.
func (c *Console) servePage(w http.ResponseWriter, r *http.Request) error {
	typed := r.URL.Path
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok {
		typed = orig.URL.Path
	}
	if !strings.HasSuffix(typed, "/") {
		if err := allowMethod(w, r, http.MethodGet); err != nil {
			return writeConsoleError(w, err)
		}
		// Relative to the typed URL, which the browser resolves: never an
		// absolute URL built from the request, and not http.Redirect,
		// which resolves against the path after handle_path stripped it.
		loc := "./" + url.PathEscape(typed[strings.LastIndex(typed, "/")+1:]) + "/"
		if r.URL.RawQuery != "" {
			loc += "?" + r.URL.RawQuery
		}
		w.Header().Set("Location", loc)
		w.WriteHeader(http.StatusPermanentRedirect)
		return nil
	}
	if err := serveDashboardPage(w, r, consolePage); err != nil {
		return writeConsoleError(w, err)
	}
	return nil
}

// crossSite reports whether r is an unsafe request that says it comes
// from another site: the browser's Sec-Fetch-Site, or an Origin that is not
// the request's own by the Fetch standard's rule (same scheme, host and
// port; an empty or opaque Origin is never same-origin).
func crossSite(r *http.Request) bool {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
		return false
	}
	switch r.Header.Get("Sec-Fetch-Site") {
	case "", "same-origin", "none":
	default:
		return true
	}
	origins, sent := r.Header["Origin"]
	return sent && (len(origins) != 1 || !sameOrigin(origins[0], r))
}

// sameOrigin reports whether origin, an Origin header's value, names the
// origin r was sent to: the scheme the browser used (the connection's, or
// X-Forwarded-Proto from one of the server's trusted proxies, which
// terminated TLS), the Host's name and its port, a scheme's default port
// when the Host names none.
func sameOrigin(origin string, r *http.Request) bool {
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" || u.User != nil || u.Path != "" || u.RawQuery != "" || u.Fragment != "" {
		return false
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	if trusted, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool); trusted {
		switch p := strings.ToLower(r.Header.Get("X-Forwarded-Proto")); p {
		case "http", "https":
			scheme = p
		}
	}
	if !strings.EqualFold(u.Scheme, scheme) {
		return false
	}
	host := &url.URL{Host: r.Host}
	return strings.EqualFold(u.Hostname(), host.Hostname()) && portOr(u, scheme) == portOr(host, scheme)
}

// portOr returns u's port, or the default port of scheme when u names none.
func portOr(u *url.URL, scheme string) string {
	if p := u.Port(); p != "" {
		return p
	}
	if scheme == "https" {
		return "443"
	}
	return "80"
}

// writeConsoleError answers an admin API error as the admin endpoint does,
// {"error": "..."} with its status.
func writeConsoleError(w http.ResponseWriter, err error) error {
	status := http.StatusInternalServerError
	var aerr caddy.APIError
	if errors.As(err, &aerr) {
		status, err = aerr.HTTPStatus, aerr.Err
	}
	body, _ := json.Marshal(map[string]string{"error": err.Error()})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, werr := w.Write(append(body, '\n'))
	return werr
}

// Interface guards
var (
	_ caddyhttp.MiddlewareHandler = (*Console)(nil)
	_ caddyfile.Unmarshaler       = (*Console)(nil)
)
