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

// charge implements Store.Charge over st, in checks and verdicts: the
// negative Costs are given back as a refund, the positive ones spent as
// one forced decision.
func charge(ctx context.Context, st decider, checks []Check, now time.Time, verdicts []Verdict) error {
	checks, verdicts = checks[:min(len(checks), len(verdicts))], verdicts[:min(len(checks), len(verdicts))]
	// Partition in place: what is spent first, then what is given back,
	// then what is neither (refused, or charged nothing).
	more, back := 0, len(checks)
	for i := 0; i < back; {
		c := &checks[i]
		switch {
		case !verdicts[i].Allowed || c.Cost == 0:
			back--
			checks[i], checks[back] = checks[back], checks[i]
			verdicts[i], verdicts[back] = verdicts[back], verdicts[i]
			continue
		case c.Cost > 0:
			checks[i], checks[more] = checks[more], checks[i]
			verdicts[i], verdicts[more] = verdicts[more], verdicts[i]
			more++
		}
		i++
	}
	for i := range checks[:back] {
		c := &checks[i]
		c.Free, c.MaxInFlight, c.Lease, c.NoBan = false, 0, "", true
		if i < more {
			c.force = true
			c.Limit.Ban, c.Limit.BanMax = 0, 0
		} else {
			c.Cost = -c.Cost
		}
	}
	var errs [2]error
	if back > more {
		errs[0] = st.Refund(ctx, checks[more:back], now, verdicts[more:back])
	}
	if more > 0 {
		errs[1] = st.Decide(ctx, checks[:more], now, verdicts[:more])
	}
	return errors.Join(errs[0], errs[1])
}
