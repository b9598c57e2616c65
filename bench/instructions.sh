#!/usr/bin/env bash
# Counts the instructions a Go benchmark runs per operation, at this
# checkout's HEAD and at an earlier commit, under valgrind's callgrind. Unlike
# time, the count hardly moves with the machine's load, so a change of a few
# percent shows on a shared, noisy host where bench/compare.sh's ratios drift
# by 20%. Each benchmark runs for N1 and for N2 iterations, and
# (count(N2) - count(N1)) / (N2 - N1) leaves out the test binary's start and
# the benchmark's set-up. Instructions are not time (cache misses, lock waits
# and the other core are not in them): read them beside bench/compare.sh and
# bench/load, not instead of them.
#
#   bench/instructions.sh <commit> <package> <benchmark>…
#   bench/instructions.sh bb40406 . BenchmarkServeHTTP/allowed BenchmarkServeHTTP/header-key
#
# Each benchmark is named as go test reports it, without the -GOMAXPROCS
# suffix; each element of the name is matched whole (an unanchored
# BenchmarkServeHTTP would also run BenchmarkServeHTTPWebSocket, unreported,
# as go test looks for its sub-benchmarks, and count its iterations). N1 and
# N2 (default 2000 and 12000) set the iterations. Needs Go, git and valgrind (Debian: apt-get
# install valgrind). The benchmarks run with GOMAXPROCS=1 and Go's
# asynchronous preemption off (callgrind fails on the preemption signals),
# and with the collector off, whose cycles would fall in one run and not in
# the other: the counts leave out what allocations cost the collector, which
# the benchmarks' allocs/op show.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bench/instructions.sh <commit> <package> <benchmark>…"
base=${1:?$usage}
pkg=${2:?$usage}
shift 2
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind is not on the PATH (Debian: apt-get install valgrind)" >&2; exit 1; }
n1=${N1:-2000}
n2=${N2:-12000}

work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; git worktree remove --force "$work/new" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/old" "$base"
git worktree add -q --detach "$work/new" HEAD
for side in old new; do
	(cd "$work/$side" && go test -c -o "$work/$side.test" "$pkg")
done

# anchored turns a benchmark's name into the -test.bench pattern that runs
# it alone: each element quoted and matched whole.
anchored() {
	local IFS=/ parts=() e
	for e in $1; do
		parts+=("^$(sed 's/[][\.^$*+?(){}|]/\\&/g' <<<"$e")\$")
	done
	echo "${parts[*]}"
}

# count <side> <pattern> <iterations> prints the instructions of one run.
count() {
	local out
	out=$(cd "$work/$1/$pkg" && GODEBUG=asyncpreemptoff=1 GOMAXPROCS=1 GOGC=off valgrind --tool=callgrind \
		--callgrind-out-file="$work/callgrind.out" "$work/$1.test" -test.run '^$' \
		-test.bench "$2" -test.benchtime "${3}x" -test.benchmem 2>&1)
	local ran
	ran=$(grep -c 'ns/op' <<<"$out" || true)
	if [ "$ran" != 1 ]; then
		echo "$1: $2 ran $ran benchmarks, want 1:" >&2
		echo "$out" >&2
		exit 1
	fi
	sed -n 's/.*Collected : \([0-9]*\).*/\1/p' <<<"$out"
}

printf '| benchmark | %s instructions/op | HEAD instructions/op | ratio |\n| --- | --- | --- | --- |\n' "$(git rev-parse --short "$base")"
for bench in "$@"; do
	declare -A per
	for side in old new; do
		echo "$bench: $side" >&2
		a=$(count "$side" "$(anchored "$bench")" "$n1")
		b=$(count "$side" "$(anchored "$bench")" "$n2")
		per[$side]=$(( (b - a) / (n2 - n1) ))
	done
	printf '| %s | %d | %d | %s |\n' "$bench" "${per[old]}" "${per[new]}" \
		"$(awk -v o="${per[old]}" -v n="${per[new]}" 'BEGIN { printf "%.2f", n / o }')"
done
