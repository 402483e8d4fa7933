#!/usr/bin/env bash
# Reproduce every number in benchmarks/README.md into benchmarks/results/ (about 12 minutes).
# The machine may be shared: every server number is the median of repeated runs.
# Needs redis-server on PATH (the Redis rows) and matplotlib (charts): pip install '.[bench]'.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
# The engine-cycle tables are LRU's (README, "The eviction policy"); every launched server
# reads this, Redis ones included (LRU is their only policy).
export KVMETA_EVICTION=${KVMETA_EVICTION:-lru}
R=benchmarks/results
REPEAT=${REPEAT:-3}
mkdir -p "$R"
B="python3 -m kvmeta bench"
NOLEASE=--server-arg=--read-lease=0

$B core --json --out "$R/core" > /dev/null
# Headline: dialect S, batch 64, 3 clients, 64k-page pool (read leases off: see README).
$B --launch $NOLEASE --pool-pages 65536 --repeat $((REPEAT + 2)) --duration 4 --json > "$R/s_batch64.json"
# The same cycle in the default configuration (serve's 5 s read lease; bench would launch with
# --read-lease=0), on a 1M-page pool (no lease cliff there).
LEASE5=--server-arg=--read-lease=5
$B --launch $LEASE5 --pool-pages 1048576 --repeat "$REPEAT" --duration 4 --json > "$R/s_batch64_default_1m.json"
# Dialect V, the same two configurations, and the in-memory mode for comparison.
$B --launch --dialect v $NOLEASE --pool-pages 65536 --repeat "$REPEAT" --duration 4 --json > "$R/v_batch64.json"
$B --launch --dialect v $LEASE5 --pool-pages 1048576 --repeat "$REPEAT" --duration 4 --json > "$R/v_batch64_default_1m.json"
$B --launch memory $NOLEASE --pool-pages 65536 --repeat "$REPEAT" --duration 4 --json > "$R/s_batch64_memory.json"
# Durability: CPU and journal bytes per request in each fsync mode (in-memory above).
for mode in never batch always; do
    $B --launch durable $NOLEASE --server-arg=--fsync=$mode --repeat "$REPEAT" --duration 4 --json > "$R/s_batch64_fsync_$mode.json"
done
# Scale-out: a private redis-server, 1, 2 and 4 workers (redis-server's CPU reported apart).
for workers in 1 2 4; do
    $B --launch redis --workers $workers --clients 4 $NOLEASE --repeat "$REPEAT" --duration 3 --json > "$R/s_batch64_redis_w$workers.json"
done
$B sweep --sweep pool --launch $NOLEASE --repeat "$REPEAT" --duration 3 --out "$R/sweep_pool" > /dev/null
$B sweep --sweep batch --launch $NOLEASE --repeat "$REPEAT" --duration 3 --out "$R/sweep_batch" > /dev/null
$B sweep --sweep clients --launch $NOLEASE --repeat "$REPEAT" --duration 3 --out "$R/sweep_clients" > /dev/null
echo "results in $R"
