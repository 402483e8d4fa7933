#!/usr/bin/env bash
# Reproduce every number in benchmarks/README.md into benchmarks/results/ (about 10 minutes).
# The machine may be shared: every server number is the median of repeated runs.
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
REPEAT=${REPEAT:-3}
mkdir -p "$R"
B="python3 benchmarks/run_bench.py"
S="python3 benchmarks/sweep.py"
NOLEASE=--server-arg=--read-lease=0

python3 benchmarks/core_bench.py --json --out "$R/core" > /dev/null
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
$S --sweep pool --launch $NOLEASE --repeat "$REPEAT" --duration 3 --out "$R/sweep_pool" > /dev/null
$S --sweep batch --launch $NOLEASE --repeat "$REPEAT" --duration 3 --out "$R/sweep_batch" > /dev/null
$S --sweep clients --launch $NOLEASE --repeat "$REPEAT" --duration 3 --out "$R/sweep_clients" > /dev/null
echo "results in $R"
