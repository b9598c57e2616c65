package tests

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// tokenBackend is a model server as a charge sees it: /tokens/N answers
// with N in X-Tokens, /fail/N too but with a 502, /stream/N streams its answer and reports N in the
// X-Tokens trailer, /raw?v=V sends V as it is, /none no header at all.
// gate, when not nil, holds every answer until it is closed, and reached
// counts the requests it holds.
func tokenBackend(t *testing.T, gate chan struct{}, reached *atomic.Int64) string {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if gate != nil {
			reached.Add(1)
			<-gate
		}
		n := r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]
		switch {
		case strings.HasPrefix(r.URL.Path, "/tokens/"):
			w.Header().Set("X-Tokens", n)
		case strings.HasPrefix(r.URL.Path, "/stream/"):
			w.Header().Set("Trailer", "X-Tokens")
			for _, part := range []string{"Once ", "upon ", "a time"} {
				io.WriteString(w, part)
				w.(http.Flusher).Flush()
			}
			w.Header().Set("X-Tokens", n)
			return
		case strings.HasPrefix(r.URL.Path, "/fail/"):
			w.Header().Set("X-Tokens", n)
			w.WriteHeader(http.StatusBadGateway)
		case r.URL.Path == "/raw":
			w.Header()["X-Tokens"] = []string{r.URL.Query().Get("v")}
		}
		io.WriteString(w, "answer")
	}))
	t.Cleanup(backend.Close)
	return backend.Listener.Addr().String()
}

// chargeSite is a token budget of 1000 per API key per minute in zone,
// charged by X-Tokens (with the charge options opts) in front of backend.
func chargeSite(zone, opts, backend, store string) string {
	return fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		key {http.request.header.X-Api-Key}
		window 60
		max 1000
		charge X-Tokens %s
		%s
	}
	reverse_proxy %s
}`, zone, opts, store, backend)
}

// spentBy returns the units the zone's listing says key spent.
func spentBy(t *testing.T, zone, key string) int {
	t.Helper()
	var list keyList
	adminJSON(t, "/rate_limit/"+zone, &list)
	for _, k := range list.Keys {
		if k.Key == key {
			return k.Count
		}
	}
	t.Logf("listing of %s: %+v", zone, list)
	return -1
}

// A key with 1000 tokens a window spends 300, 500 and 250 as its answers
// report, in a header or in a streamed answer's trailer, and is refused
// next; each answer's headers show what was left when it was admitted.
func TestChargeTokenBudget(t *testing.T) {
	backend := tokenBackend(t, nil, nil)
	for _, path := range []string{"/tokens/", "/stream/"} {
		t.Run(strings.Trim(path, "/"), func(t *testing.T) {
			zone := fresh("e2e-charge-" + strings.Trim(path, "/"))
			s := startCaddy(t, "", chargeSite(zone, "hide", backend, ""))
			for i, step := range []struct{ tokens, left int }{{300, 999}, {500, 699}, {250, 199}} {
				resp, body := s.get(path+strconv.Itoa(step.tokens), "X-Api-Key", "alice")
				wantStatus(t, resp, http.StatusOK)
				wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(step.left))
				if body == "" || resp.Header.Get("X-Tokens") != "" || resp.Trailer.Get("X-Tokens") != "" {
					t.Fatalf("answer %d: body %q, header %q, trailer %q; want the answer with X-Tokens hidden",
						i+1, body, resp.Header.Get("X-Tokens"), resp.Trailer.Get("X-Tokens"))
				}
			}
			if n := spentBy(t, zone, "key:alice"); n != 1050 {
				t.Fatalf("listing: alice spent %d, want 1050 (%s)", n, zone)
			}
			resp, _ := s.get(path+"1", "X-Api-Key", "alice")
			wantStatus(t, resp, http.StatusTooManyRequests)
			wantHeader(t, resp, "X-RateLimit-Remaining", "0")
			if resp, _ := s.get(path+"1", "X-Api-Key", "bob"); resp.StatusCode != http.StatusOK {
				t.Fatalf("another key: status %d, want 200", resp.StatusCode)
			}
			m := scrape(t, zone)
			if got := m[series("charged_units_total", zone, "")]; got != 1051 {
				t.Fatalf("charged units = %v, want 1051", got)
			}
		})
	}
}

// Without hide, the client sees the charge its upstream reported.
func TestChargeShown(t *testing.T) {
	zone := fresh("e2e-charge-shown")
	s := startCaddy(t, "", chargeSite(zone, "", tokenBackend(t, nil, nil), ""))
	resp, _ := s.get("/tokens/42", "X-Api-Key", "alice")
	wantHeader(t, resp, "X-Tokens", "42")
	resp, _ = s.get("/tokens/1", "X-Api-Key", "alice")
	wantHeader(t, resp, "X-RateLimit-Remaining", "957")
}

// Broken charges (-5, abc, 1e30, empty, none at all) keep the estimate,
// are logged once and counted by reason; 0 gives the estimate back.
func TestChargeBrokenValues(t *testing.T) {
	zone := fresh("e2e-charge-broken")
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	s := startCaddy(t, fmt.Sprintf("log {\n\t\toutput file %s\n\t\tformat json\n\t}", logFile),
		chargeSite(zone, "estimate 10", tokenBackend(t, nil, nil), ""))
	left := 1000
	for _, v := range []string{"-5", "abc", "1e30", "", "99999999999"} {
		left -= 10
		resp, _ := s.get("/raw?v="+v, "X-Api-Key", "alice")
		wantStatus(t, resp, http.StatusOK)
		wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(left))
	}
	left -= 10
	resp, _ := s.get("/none", "X-Api-Key", "alice")
	wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(left))
	for range 2 {
		resp, _ := s.get("/tokens/0", "X-Api-Key", "alice")
		wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(left-10))
	}
	if n := spentBy(t, zone, "key:alice"); n != 60 {
		t.Fatalf("listing: alice spent %d, want 60 (six estimates of 10)", n)
	}
	m := scrape(t, zone)
	invalid := series("invalid_charges_total", zone, "invalid")
	missing := series("invalid_charges_total", zone, "missing")
	if m[invalid] != 5 || m[missing] != 1 || m[series("charged_units_total", zone, "")] != 60 {
		t.Fatalf("metrics %v: want 5 invalid, 1 missing, 60 units charged", m)
	}
	if n := logged(t, logFile, "response charge is missing"); n != 1 {
		t.Fatalf("%d log lines about a broken charge, want 1", n)
	}
}

// logged counts the lines of the JSON log at path whose message begins
// with msg.
func logged(t *testing.T, path, msg string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var entry struct{ Msg string }
		if json.Unmarshal(sc.Bytes(), &entry) == nil && strings.HasPrefix(entry.Msg, msg) {
			n++
		}
	}
	return n
}

// Eight concurrent requests of one key each charged 300 of 1000 stay
// within the bound of docs/charges.md, max + n·(C − E): with the default
// estimate every one is admitted (1000 + 8·299 = 3392 at most; 2400
// spent), with an estimate of 300 only three.
func TestChargeOverspendBound(t *testing.T) {
	srv := redistest.Start(t)
	stores := map[string]string{"memory": "", "redis": fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t}", srv.Addr)}
	for name, store := range stores {
		for _, tc := range []struct {
			opts            string
			admitted, spent int
		}{{"", 8, 2400}, {"estimate 300", 3, 900}} {
			t.Run(name+"/"+cmp.Or(strings.ReplaceAll(tc.opts, " ", "-"), "default"), func(t *testing.T) {
				gate, reached := make(chan struct{}), new(atomic.Int64)
				zone := fresh("e2e-charge-bound")
				s := startCaddy(t, "", chargeSite(zone, tc.opts, tokenBackend(t, gate, reached), store))
				var wg sync.WaitGroup
				var mu sync.Mutex
				statuses := map[int]int{}
				for range 8 {
					wg.Go(func() {
						resp := request(t, s.Base, "/tokens/300", "X-Api-Key", "alice")
						mu.Lock()
						statuses[resp.StatusCode]++
						mu.Unlock()
					})
				}
				// Every request is admitted (and held by the backend) or
				// refused before any answer is charged.
				decided := func() bool {
					mu.Lock()
					defer mu.Unlock()
					return reached.Load()+int64(statuses[http.StatusTooManyRequests]) == 8
				}
				if !eventually(decided) {
					t.Errorf("%d at the backend, statuses %v before the answers; want 8 decided", reached.Load(), statuses)
				}
				close(gate)
				wg.Wait()
				if statuses[http.StatusOK] != tc.admitted {
					t.Fatalf("statuses %v, want %d admitted", statuses, tc.admitted)
				}
				var n int
				if !eventually(func() bool { n = spentBy(t, zone, "key:alice"); return n == tc.spent }) {
					t.Fatalf("listing: alice spent %d, want %d", n, tc.spent)
				}
			})
		}
	}
}

// A request limit and a token budget in one handler: each counts its own
// way, and a response count_status does not count is not charged.
func TestChargeBesideRequestLimit(t *testing.T) {
	zone := fresh("e2e-charge-two")
	s := startCaddy(t, "", fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		key {http.request.header.X-Api-Key}
		window 60
		max 3
		limit tokens 1000 60 {
			charge X-Tokens
			count_status 2xx
		}
	}
	reverse_proxy %s
}`, zone, tokenBackend(t, nil, nil)))
	for _, path := range []string{"/tokens/100", "/fail/400", "/tokens/200"} {
		s.get(path, "X-Api-Key", "alice")
	}
	resp, _ := s.get("/tokens/1", "X-Api-Key", "alice")
	wantStatus(t, resp, http.StatusTooManyRequests) // the request limit: 3 a minute
	var list keyList
	adminJSON(t, "/rate_limit/"+zone, &list)
	got := map[string]int{}
	for _, k := range list.Keys {
		got[k.Policy] = k.Count
	}
	if got[zone] != 3 || got["tokens"] != 300 {
		t.Fatalf("listing %+v: want 3 requests and 300 tokens (the 502's 400 not charged)", list.Keys)
	}
}
