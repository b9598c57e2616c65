package limiter

import (
	"context"
	"errors"
	"time"
)

// decider is what settling a charge needs of a store: its decisions and
// its refunds.
type decider interface {
	Decide(ctx context.Context, checks []Check, now time.Time, out []Verdict) error
	Refund(ctx context.Context, checks []Check, now time.Time, verdicts []Verdict) error
}

// forcedMax is the max a Redis script is told for a forced check: no count
// reaches it, so the script admits the check and starts no ban.
const forcedMax = 1 << 50

// charge implements Store.Charge over st: the positive Costs as one forced
// decision, the negative ones as a refund.
func charge(ctx context.Context, st decider, checks []Check, now time.Time, verdicts []Verdict) error {
	var more, back [MaxChecks]Check
	var backOut [MaxChecks]Verdict
	nm, nb := 0, 0
	for i := range checks {
		c := checks[i]
		if i >= len(verdicts) || !verdicts[i].Allowed || c.Cost == 0 || nm+nb == MaxChecks {
			continue
		}
		c.Free, c.MaxInFlight, c.Lease, c.NoBan = false, 0, "", true
		if c.Cost < 0 {
			c.Cost = -c.Cost
			back[nb], backOut[nb] = c, verdicts[i]
			nb++
			continue
		}
		c.force = true
		c.Limit.Ban, c.Limit.BanMax = 0, 0
		more[nm] = c
		nm++
	}
	var errs [2]error
	if nm > 0 {
		var out [MaxChecks]Verdict
		errs[0] = st.Decide(ctx, more[:nm], now, out[:nm])
	}
	if nb > 0 {
		errs[1] = st.Refund(ctx, back[:nb], now, backOut[:nb])
	}
	return errors.Join(errs[0], errs[1])
}
