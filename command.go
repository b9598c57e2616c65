package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "rate-limit",
		Usage: "zones | top <zone> [--by recent_refusals|count] [--limited] [--prefix <p>] [--policy <name>] [-n <n>] | unblock <zone> <key> | override list|set|rm <zone> [<key>]",
		Short: "Lists rate limit zones and offenders, unblocks clients, overrides their limits",
		Long: `Talks to the admin API of a running Caddy (the rate_limit module's endpoints
under /rate_limit/) and prints aligned tables, or the API's JSON with --json.

  caddy rate-limit zones                  every zone: settings, keys, refusals
  caddy rate-limit top <zone>             the zone's offenders of the last 5m,
                                          most refused first
        [--by count] [--limited] [--prefix <p>] [--policy <name>] [-n <n>]
  caddy rate-limit unblock <zone> <key>   forget the key now [--policy <name>]
  caddy rate-limit override list <zone>   the zone's overrides
  caddy rate-limit override set <zone> <key> --plan <name> | --max <n>
        [--burst <n>] [--off] [--limit <name>=<max>|off ...] [--ttl <d>]
                                          set the key's override
  caddy rate-limit override rm <zone> <key>
                                          remove it

The admin endpoint is found as 'caddy reload' finds it: --address if given,
else the admin address of the --config file, else ` + "localhost:2019" + `.

A call the admin API refuses exits with status 1 and prints the API's error
on stderr; unblock of a key the zone does not track answers 404:

  Error: caddy responded with error: HTTP 404: {"error":"key \"192.0.2.7\" is not tracked in zone \"api\""}

Keys are text that clients choose: a key that is not printable ASCII without
spaces is printed quoted, in ASCII with Go's escapes, so that the table stays
aligned and no key passes for columns of its own. --json gives keys as they are.`,
		CobraFunc: func(cmd *cobra.Command) {
			// Caddy's footer points to its command-line page, which does
			// not cover this command.
			cmd.SetHelpTemplate(cmd.HelpTemplate() + "\n" + docsFooter + "\n")
			cmd.PersistentFlags().String("address", "", "Address of the administration API listener, if different from config")
			cmd.PersistentFlags().StringP("config", "c", "", "Configuration file to read the admin address from")
			cmd.PersistentFlags().StringP("adapter", "a", "", "Name of config adapter to apply (with --config)")
			cmd.PersistentFlags().Bool("json", false, "Print the admin API's JSON instead of a table")

			top := &cobra.Command{
				Use:   "top <zone>",
				Short: "Lists the zone's offenders, most refused in the last 5m first",
				Args:  cobra.ExactArgs(1),
				RunE:  cmdTop,
			}
			top.Flags().String("by", SortRecentRefusals, "Order: "+SortRecentRefusals+" (refusals in the last 5m, in any limit) or "+SortCount+" (requests in the current window)")
			top.Flags().Bool("limited", false, "Only keys over their limit now")
			top.Flags().String("prefix", "", "Only keys starting with this prefix")
			top.Flags().String("policy", "", "Only keys counted in this limit")
			top.Flags().IntP("n", "n", 20, fmt.Sprintf("How many keys to list, 1 to %d", MaxPageSize))
			unblock := &cobra.Command{Use: "unblock <zone> <key>", Short: "Forgets a key so its next request starts afresh", Args: cobra.ExactArgs(2), RunE: cmdUnblock}
			unblock.Flags().String("policy", "", "Forget the key in this limit only (default: in every limit)")
			cmd.AddCommand(
				&cobra.Command{Use: "zones", Short: "Lists every zone", Args: cobra.NoArgs, RunE: cmdZones},
				top,
				unblock,
				overrideCommand(),
			)
		},
	})
}

// docsFooter ends the help of caddy rate-limit and its subcommands.
const docsFooter = `Full documentation: docs/admin-api.md ("Command line") of
github.com/caddy-rate-limit/caddy-rate-limit`

// adminCall sends a request to the admin endpoint the flags name and
// returns the reply's body; an error reply is an error.
func adminCall(cmd *cobra.Command, method, uri string) ([]byte, error) {
	return adminSend(cmd, method, uri, nil)
}

// adminSend is adminCall with body (JSON) as the request's body.
func adminSend(cmd *cobra.Command, method, uri string, body []byte) ([]byte, error) {
	flags := cmd.Flags()
	address, _ := flags.GetString("address")
	config, _ := flags.GetString("config")
	adapter, _ := flags.GetString("adapter")
	addr, err := caddycmd.DetermineAdminAPIAddress(address, nil, config, adapter)
	if err != nil {
		return nil, fmt.Errorf("finding the admin endpoint: %v", err)
	}
	header := http.Header{"Accept": {"application/json"}}
	var reader io.Reader
	if body != nil {
		header.Set("Content-Type", "application/json")
		reader = bytes.NewReader(body)
	}
	resp, err := caddycmd.AdminAPIRequest(addr, method, uri, header, reader)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(io.LimitReader(resp.Body, 64<<20))
}

// printJSON prints body as it came when --json is set, and reports whether
// it did.
func printJSON(cmd *cobra.Command, body []byte) bool {
	if asJSON, _ := cmd.Flags().GetBool("json"); !asJSON {
		return false
	}
	cmd.OutOrStdout().Write(body)
	return true
}

func cmdZones(cmd *cobra.Command, _ []string) error {
	body, err := adminCall(cmd, http.MethodGet, adminPrefix)
	if err != nil || printJSON(cmd, body) {
		return err
	}
	var zones []ZoneInfo
	if err := json.Unmarshal(body, &zones); err != nil {
		return fmt.Errorf("decoding the zone list: %v", err)
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ZONE\tSTATUS\tSTORE\tHEALTH\tWINDOW\tMAX\tKEYS\tREFUSED\tWEBSOCKETS")
	for _, z := range zones {
		health := z.Health
		if health == "" {
			health = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%d\n", z.Name, z.Status, z.Store, health,
			humanDuration(time.Duration(z.WindowSeconds)*time.Second), z.Max, trackedText(z), z.RejectedTotal, z.WebSocketConnections)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// Under the table, on stderr, so that stdout stays one table.
	for _, z := range zones {
		if z.SpoofableKey {
			fmt.Fprintf(cmd.ErrOrStderr(), "warning: zone %s: %s\n", z.Name, spoofableKeyNote)
		}
	}
	return nil
}

// trackedText is the zone's tracked keys for the KEYS column: with the age
// of a Redis zone's count when it is older than the reply ("462660 (12s
// ago)"), or ">=N" while no count has finished, so that a count under way
// never reads as a bare 0.
func trackedText(z ZoneInfo) string {
	switch {
	case z.TrackedKeysPartial:
		return ">=" + strconv.Itoa(z.TrackedKeys)
	case z.TrackedKeysAgeSeconds > 0:
		return fmt.Sprintf("%d (%s ago)", z.TrackedKeys, humanDuration(time.Duration(z.TrackedKeysAgeSeconds)*time.Second))
	}
	return strconv.Itoa(z.TrackedKeys)
}

// spoofableKeyNote is what the zones command says of a zone whose clients
// choose their own key (ZoneInfo.SpoofableKey).
const spoofableKeyNote = "clients behind a trusted proxy choose their own key (Caddy takes the leftmost X-Forwarded-For address " +
	"without trusted_proxies_strict): set trusted_proxies_strict, and list every proxy in front of Caddy " +
	"(a CDN and the load balancer both) in trusted_proxies; see docs/security.md"

func cmdTop(cmd *cobra.Command, args []string) error {
	n, _ := cmd.Flags().GetInt("n")
	if n < 1 || n > MaxPageSize {
		return fmt.Errorf("invalid -n %d: must be from 1 to %d", n, MaxPageSize)
	}
	by, _ := cmd.Flags().GetString("by")
	if by != SortRecentRefusals && by != SortCount {
		return fmt.Errorf("invalid --by %q: must be %s or %s", by, SortRecentRefusals, SortCount)
	}
	q := url.Values{"limit": {strconv.Itoa(n)}, "sort": {by}}
	if limited, _ := cmd.Flags().GetBool("limited"); limited {
		q.Set("limited", "true")
	}
	if prefix, _ := cmd.Flags().GetString("prefix"); prefix != "" {
		q.Set("q", prefix)
	}
	if policy, _ := cmd.Flags().GetString("policy"); policy != "" {
		q.Set("policy", policy)
	}
	body, err := adminCall(cmd, http.MethodGet, adminPrefix+url.PathEscape(args[0])+"?"+q.Encode())
	if err != nil || printJSON(cmd, body) {
		return err
	}
	var list KeyList
	if err := json.Unmarshal(body, &list); err != nil {
		return fmt.Errorf("decoding the key list: %v", err)
	}
	return printKeys(cmd.OutOrStdout(), list, by, time.Now())
}

// printKeys prints a page of keys as top shows it, in the order by names:
// a table, then a line with how many keys matched; times are counted from
// now.
func printKeys(out io.Writer, list KeyList, by string, now time.Time) error {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	recent := by == SortRecentRefusals
	// A column for requests in flight when a listed key has some: a zone
	// without max_in_flight keeps its table.
	flying := slices.ContainsFunc(list.Keys, func(k KeyInfo) bool { return k.InFlight > 0 })
	if recent {
		fmt.Fprint(tw, "KEY\tPOLICY\tRECENT REFUSALS\tLAST REFUSED\t")
	} else {
		fmt.Fprint(tw, "KEY\tPOLICY\t")
	}
	fmt.Fprint(tw, "COUNT\tREFUSED\tREMAINING\tRESETS IN\tLIMITED")
	if flying {
		fmt.Fprint(tw, "\tIN FLIGHT")
	}
	fmt.Fprintln(tw)
	for _, k := range list.Keys {
		limited, reset := "no", k.Reset
		if k.Limited {
			limited = "yes"
		}
		if k.BannedUntil != 0 {
			// Refused until the ban ends.
			limited, reset = "banned", max(reset, k.BannedUntil)
		}
		if recent {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s ago\t", terminalText(k.Key), k.Policy, k.RecentRefusals,
				humanDuration(now.Sub(time.Unix(k.LastRefused, 0))))
		} else {
			fmt.Fprintf(tw, "%s\t%s\t", terminalText(k.Key), k.Policy)
		}
		if reset == 0 {
			// Among the offenders only: no window runs for the key.
			fmt.Fprintf(tw, "-\t-\t-\t-\t%s", limited)
		} else {
			fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%s", k.Count, k.Refused, k.Remaining,
				humanDuration(time.Unix(reset, 0).Sub(now)), limited)
		}
		if flying {
			fmt.Fprintf(tw, "\t%d", k.InFlight)
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if recent {
		_, err := fmt.Fprintf(out, "%d of %d keys refused in the last %s in zone %s\n", len(list.Keys), list.Total, humanDuration(OffenderAge), list.Zone)
		return err
	}
	_, err := fmt.Fprintf(out, "%d of %d keys in zone %s\n", len(list.Keys), list.Total, list.Zone)
	return err
}

func cmdUnblock(cmd *cobra.Command, args []string) error {
	zone, key := args[0], args[1]
	q := url.Values{"key": {key}}
	if policy, _ := cmd.Flags().GetString("policy"); policy != "" {
		q.Set("policy", policy)
	}
	body, err := adminCall(cmd, http.MethodDelete, adminPrefix+url.PathEscape(zone)+"?"+q.Encode())
	if err != nil || printJSON(cmd, body) {
		return err
	}
	_, err = fmt.Fprintf(cmd.OutOrStdout(), "unblocked %s in zone %s\n", terminalText(key), zone)
	return err
}

// terminalText returns a key as it may be printed in a table: as it is when
// it is plain, otherwise quoted with Go's escapes in ASCII
// (strconv.QuoteToASCII). A key is client-chosen text, and a table trusts
// each cell to be one column wide per byte and free of layout: a space or a
// tab could make a key pass for columns of its own ("1.2.3.4   999   0"),
// any non-ASCII character may be two columns wide (CJK, emoji) or none
// (zero-width, combining), reorder the line (bidi overrides) or not be
// text at all, and a control character could move the cursor or recolour
// the screen. So plain is non-empty printable ASCII without spaces, and not
// starting with a quote, which would read as a quoted key.
func terminalText(s string) string {
	plain := s != "" && s[0] != '"'
	for i := 0; i < len(s) && plain; i++ {
		plain = '!' <= s[i] && s[i] <= '~'
	}
	if plain {
		return s
	}
	return strconv.QuoteToASCII(s)
}

// humanDuration writes d as people write durations, in whole seconds
// without zero parts: 1m, 15m, 1h30m, 1m30s; 0s for none or less.
// time.Duration's String writes 1m0s.
func humanDuration(d time.Duration) string {
	d = d.Truncate(time.Second)
	if d <= 0 {
		return "0s"
	}
	var b []byte
	for _, u := range []struct {
		unit   time.Duration
		suffix byte
	}{{time.Hour, 'h'}, {time.Minute, 'm'}, {time.Second, 's'}} {
		if n := d / u.unit; n > 0 {
			b = append(strconv.AppendInt(b, int64(n), 10), u.suffix)
			d -= n * u.unit
		}
	}
	return string(b)
}
