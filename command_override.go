package ratelimit

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/spf13/cobra"
)

// overrideCommand is "caddy rate-limit override": list, set and remove
// the overrides of a zone.
func overrideCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "override", Short: "Lists, sets and removes the overrides of a zone"}
	set := &cobra.Command{
		Use:   "set <zone> <key>",
		Short: "Sets the key's override: a plan, or values of its own",
		Args:  cobra.ExactArgs(2),
		RunE:  cmdOverrideSet,
	}
	set.Flags().String("plan", "", "The plan the key runs with (default: the handler's own values)")
	set.Flags().Int("max", 0, "The first limit's max for the key")
	set.Flags().Int("burst", 0, "The first limit's burst for the key (algorithm gcra)")
	set.Flags().Bool("off", false, "Switch the first limit off for the key")
	set.Flags().StringArray("limit", nil, "Another limit's value for the key, <name>=<max> or <name>=off (repeatable)")
	set.Flags().String("ttl", "", "How long the override lasts, such as 1h or 30m (default: until removed)")
	cmd.AddCommand(
		&cobra.Command{Use: "list <zone>", Short: "Lists the zone's overrides", Args: cobra.ExactArgs(1), RunE: cmdOverrideList},
		set,
		&cobra.Command{Use: "rm <zone> <key>", Short: "Removes the key's override", Args: cobra.ExactArgs(2), RunE: cmdOverrideRemove},
	)
	return cmd
}

// overridesURI is the admin path of zone's overrides.
func overridesURI(zone string) string {
	return adminPrefix + url.PathEscape(zone) + overridesPath
}

func cmdOverrideList(cmd *cobra.Command, args []string) error {
	body, err := adminCall(cmd, http.MethodGet, overridesURI(args[0]))
	if err != nil || printJSON(cmd, body) {
		return err
	}
	var list OverrideList
	if err := json.Unmarshal(body, &list); err != nil {
		return fmt.Errorf("decoding the override list: %v", err)
	}
	return printOverrides(cmd, list, time.Now())
}

// printOverrides prints a zone's overrides as a table, then how many.
func printOverrides(cmd *cobra.Command, list OverrideList, now time.Time) error {
	out := cmd.OutOrStdout()
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tPLAN\tVALUES\tEXPIRES IN")
	for _, o := range list.Overrides {
		key, plan, expires := o.Key, o.Plan, "never"
		if key == "" {
			key = "hash " + o.KeyHash
		}
		if plan == "" {
			plan = "-"
		}
		if o.Expires != 0 {
			expires = humanDuration(time.Unix(o.Expires, 0).Sub(now))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", terminalText(key), plan, valuesText(o.PlanConfig), expires)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(out, "%d overrides in zone %s (at most %d)\n", len(list.Overrides), list.Zone, list.Max)
	return err
}

// valuesText writes an override's values as the set command takes them:
// "max=9 hourly=90 tenant=off", or "-" for none.
func valuesText(pc PlanConfig) string {
	var parts []string
	add := func(name string, pl PlanLimit) {
		switch {
		case pl.Off:
			parts = append(parts, name+"=off")
		case pl.Max != 0:
			parts = append(parts, name+"="+strconv.Itoa(pl.Max))
		}
		if pl.Burst != 0 {
			parts = append(parts, name+".burst="+strconv.Itoa(pl.Burst))
		}
	}
	add("max", pc.PlanLimit)
	for _, name := range slices.Sorted(maps.Keys(pc.Limits)) {
		add(name, pc.Limits[name])
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " ")
}

func cmdOverrideSet(cmd *cobra.Command, args []string) error {
	flags := cmd.Flags()
	o := Override{Key: args[1]}
	o.Plan, _ = flags.GetString("plan")
	o.Max, _ = flags.GetInt("max")
	o.Burst, _ = flags.GetInt("burst")
	o.Off, _ = flags.GetBool("off")
	limits, _ := flags.GetStringArray("limit")
	for _, l := range limits {
		name, value, ok := strings.Cut(l, "=")
		if !ok || name == "" {
			return fmt.Errorf("invalid --limit %q: want <name>=<max> or <name>=off", l)
		}
		var pl PlanLimit
		if value == "off" {
			pl.Off = true
		} else if n, err := strconv.Atoi(value); err == nil {
			pl.Max = n
		} else {
			return fmt.Errorf("invalid --limit %q: %q is neither a number nor off", l, value)
		}
		if o.Limits == nil {
			o.Limits = map[string]PlanLimit{}
		}
		o.Limits[name] = pl
	}
	if ttl, _ := flags.GetString("ttl"); ttl != "" {
		d, err := caddy.ParseDuration(ttl)
		if err != nil {
			return fmt.Errorf("invalid --ttl %q: %v", ttl, err)
		}
		o.TTL = caddy.Duration(d)
	}
	body, _ := json.Marshal(o)
	reply, err := adminSend(cmd, http.MethodPut, overridesURI(args[0]), body)
	if err != nil || printJSON(cmd, reply) {
		return err
	}
	var set Override
	if err := json.Unmarshal(reply, &set); err != nil {
		return fmt.Errorf("decoding the override: %v", err)
	}
	what := "plan " + set.Plan
	if set.Plan == "" {
		what = valuesText(set.PlanConfig)
	}
	if set.Expires != 0 {
		what += " until " + time.Unix(set.Expires, 0).UTC().Format(time.RFC3339)
	}
	_, err = fmt.Fprintf(cmd.OutOrStdout(), "override of %s in zone %s: %s\n", terminalText(set.Key), args[0], what)
	return err
}

func cmdOverrideRemove(cmd *cobra.Command, args []string) error {
	zone, key := args[0], args[1]
	body, err := adminCall(cmd, http.MethodDelete, overridesURI(zone)+"?"+url.Values{"key": {key}}.Encode())
	if err != nil || printJSON(cmd, body) {
		return err
	}
	_, err = fmt.Fprintf(cmd.OutOrStdout(), "removed the override of %s in zone %s\n", terminalText(key), zone)
	return err
}
