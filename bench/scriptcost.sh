#!/usr/bin/env bash
# Measures Redis's own time per call (usec_per_call of INFO commandstats) of
# the fixed-window decision script at an earlier commit and at this
# checkout's working tree, alternately, on a redis-server of its own. It is
# the figure the Redis load runs cannot give on a shared host: Redis's time
# is what a script change moves, and Redis shares the host's cores with
# Caddy and wrk there.
#
#   bench/scriptcost.sh <commit> [rounds] [running|new]
#   bench/scriptcost.sh 10fac4c 6 running
#
# running (the default) sends 300,000 decisions over 100,000 keys whose
# windows are running after the first round; new empties Redis before each
# side's run and sends 200,000 decisions over random keys of a billion, so
# that nearly every decision opens a new window. Each line gives the two
# sides' µs per call and their ratio; the last, the median of the ratios.
# Needs git, redis-server, redis-cli and redis-benchmark (Debian: apt-get
# install redis-server redis-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bench/scriptcost.sh <commit> [rounds] [running|new]"
base=${1:?$usage}
rounds=${2:-6}
mode=${3:-running}
case $mode in running | new) ;; *) echo "$usage" >&2; exit 2 ;; esac
script=internal/limiter/redis_fixed.lua
for tool in redis-server redis-cli redis-benchmark; do
	command -v $tool >/dev/null || { echo "$tool is not on the PATH (Debian: apt-get install redis-server redis-tools)" >&2; exit 1; }
done

work=$(mktemp -d)
sock=$work/redis.sock
# A Unix socket and no TCP port: nothing else can share it.
redis-server --port 0 --unixsocket "$sock" --save '' --appendonly no --daemonize yes \
	--pidfile "$work/redis.pid" --logfile "$work/redis.log"
trap 'redis-cli -s "$sock" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
for _ in $(seq 50); do [ -S "$sock" ] && break; sleep 0.1; done
r() { redis-cli -s "$sock" "$@"; }
old=$(r script load "$(git show "$base:$script")")
new=$(r script load "$(cat $script)")

# run <sha>: one side's µs per call.
run() {
	local n=300000 keys=100000
	if [ "$mode" = new ]; then
		r flushall >/dev/null
		n=200000 keys=1000000000
	fi
	r config resetstat >/dev/null
	redis-benchmark -s "$sock" -n $n -P 16 -c 4 -r $keys -q \
		evalsha "$1" 2 '{k__rand_int__}:c' '{k__rand_int__}:r' 1000000000 60000 60000 1 >/dev/null
	r info commandstats | sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p'
}

[ "$mode" = new ] || run "$old" >/dev/null # the keys' windows start
echo "round  $base µs  working tree µs  ratio"
ratios=()
for i in $(seq "$rounds"); do
	a=$(run "$old")
	b=$(run "$new")
	ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", b / a }')
	ratios+=("$ratio")
	echo "$i  $a  $b  $ratio"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "median ratio %.3f over %d rounds\n", m, NR }'
