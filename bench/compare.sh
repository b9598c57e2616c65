#!/usr/bin/env bash
# Compares Go benchmarks of this checkout's HEAD with an earlier commit,
# alternating the two (A B A B …) so that the noise of a shared machine falls
# on both, and prints the median of each benchmark with the ratio.
#
#   bench/compare.sh <commit> [rounds] [bench regexp] [packages…]
#   bench/compare.sh 74fd84e 3 'BenchmarkServeHTTP|BenchmarkRedisHit' . ./internal/limiter/
#
# Needs Go, git and python3; the Redis benchmarks start their own redis-server.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: bench/compare.sh <commit> [rounds] [bench regexp] [packages…]}
rounds=${2:-3}
pattern=${3:-.}
shift $(( $# < 3 ? $# : 3 ))
pkgs=("$@")
[ ${#pkgs[@]} -gt 0 ] || pkgs=(./...)

work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; git worktree remove --force "$work/new" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/old" "$base"
git worktree add -q --detach "$work/new" HEAD
for side in old new; do # compile first, so the rounds time the code only
	(cd "$work/$side" && go test -run '^$' -bench '^$' "${pkgs[@]}" >/dev/null)
done
for round in $(seq "$rounds"); do
	for side in old new; do
		echo "round $round: $side" >&2
		# Log lines of the handler may share a line with a result: only
		# the result is kept.
		(cd "$work/$side" && go test -run '^$' -bench "$pattern" -benchmem -count 2 "${pkgs[@]}" 2>/dev/null) |
			grep -E '^Benchmark[^ 	]+[ 	]+[0-9]+[ 	]+[0-9.]+ ns/op' >>"$work/$side.txt" || true
	done
done
python3 - "$work/old.txt" "$work/new.txt" "$base" <<'PY'
import collections, re, statistics, sys
def load(path):
    d = collections.defaultdict(list)
    for line in open(path):
        m = re.match(r'(Benchmark\S+)\s+\d+\s+([\d.]+) ns/op', line)
        if m:
            b = re.search(r'\s(\d+) B/op', line); a = re.search(r'\s(\d+) allocs/op', line)
            d[m[1]].append((float(m[2]), b and b[1], a and a[1]))
    return d
old, new = load(sys.argv[1]), load(sys.argv[2])
print(f"{'benchmark':50} {sys.argv[3][:10]+' ns':>13} {'HEAD ns':>10} {'ratio':>6}  B/op, allocs (before -> after)")
for k in old:
    if k not in new:
        continue
    a = statistics.median(x[0] for x in old[k]); b = statistics.median(x[0] for x in new[k])
    mem = f"{old[k][0][1]}, {old[k][0][2]} -> {new[k][0][1]}, {new[k][0][2]}" if old[k][0][1] else ""
    print(f"{k:50} {a:13.1f} {b:10.1f} {b/a:6.2f}  {mem}")
PY
