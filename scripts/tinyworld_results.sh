#!/usr/bin/env bash
# The README's tiny-world results: the bundled model at the default settings, with its bundled
# calibration for the default probe (models/calibration/0706ef….probe0.05.json; every result
# file records the calibration's path and sha256). Not part of CI.
#   bash scripts/tinyworld_results.sh     # about 1 hour on 2 cores
# Writes bench/results/tinyworld.json (five workloads at N = 20, every budget, text similarity
# beside), its plots, and bench/results/phrasing.json; prints the README's results table.
# The calibration itself is remade by scripts/deeper_recipe_results.sh; more steps (N = 30, 50)
# by bench/many_steps.py (docs/results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
R=bench/results
mkdir -p out
both() {  # run two commands in parallel; fail if either fails
  bash -c "$1" & local a=$!
  bash -c "$2" & local b=$!
  wait "$a" && wait "$b"
}
RUN="$PY bench/tinyworld.py"
COMMON="--budgets 0.02 0.05 0.1 --no-sparse-system --records --no-plots --threads 1"
both "$RUN serve $COMMON --out out/d20_serve.json && $RUN serve_reworded $COMMON --out out/d20_serve_reworded.json \
        && $RUN novel $COMMON --out out/d20_novel.json" \
     "$RUN iterate $COMMON --out out/d20_iterate.json && $RUN iterate_replicate $COMMON --out out/d20_iterate_replicate.json"
$RUN --merge out/d20_serve.json out/d20_serve_reworded.json out/d20_iterate.json out/d20_iterate_replicate.json \
    out/d20_novel.json --out $R/tinyworld.json
$PY bench/studies/phrasing.py --threads 2 --out $R/phrasing.json
$PY bench/report.py --headline
