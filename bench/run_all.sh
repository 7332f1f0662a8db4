#!/usr/bin/env bash
# Run every benchmark one after another (never two at once on a 2-core machine) and keep each
# one's output in bench-results/. Usage: bash bench/run_all.sh
set -u
cd "$(dirname "$0")/.."
mkdir -p bench-results
for b in deadline admission edge edge_paths retry transport observability quota fleet_limit idempotency degrade lab_generator; do
  echo "== bench/${b}_bench.py"
  start=$(date +%s)
  .venv/bin/python "bench/${b}_bench.py" > "bench-results/${b}.txt" 2>&1
  echo "   exit $? in $(( $(date +%s) - start )) s"
done
