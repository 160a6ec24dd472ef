#!/usr/bin/env bash
# The default settings' tiny-world numbers, measured on the bundled model (not part of CI).
# bench/results/tinyworld*.json, calibration_measurements.* and localization_caption_model.json
# hold its numbers for the caption-trained model (models/tinyworld_caption/); the bundled
# model's default-settings runs are bench/results/studies/tinyworld_lang2_recurring_*.json.
# Two processes at a time (one per core): calibration in two shards, then the workloads,
# then the localization check and the depth studies; bench/report.py prints the README tables.
#   bash scripts/tinyworld_results.sh          # about 2 hours on 2 cores (calibration ~50 min)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
R=bench/results
both() {  # run two commands in parallel; fail if either fails
  bash -c "$1" & local a=$!
  bash -c "$2" & local b=$!
  wait "$a" && wait "$b"
}
both "$PY bench/calibrate.py --shard 0/2 --cache out/tinyworld_cache" \
     "$PY bench/calibrate.py --shard 1/2 --cache out/tinyworld_cache"
$PY bench/calibrate.py --cache out/tinyworld_cache \
    --instances $R/calibration_measurements.0-of-2.jsonl $R/calibration_measurements.1-of-2.jsonl
COMMON="--records --no-plots --budgets 0.02 0.05 0.1"
both "$PY bench/tinyworld.py iterate $COMMON --out out/tinyworld_iterate.json && \
      $PY bench/tinyworld.py iterate_replicate $COMMON --no-sparse-system \
        --out out/tinyworld_iterate_replicate.json && \
      $PY bench/tinyworld.py novel $COMMON --no-sparse-system --out out/tinyworld_novel.json" \
     "$PY bench/tinyworld.py serve $COMMON --easycache 0.02 0.05 0.2 --easycache-carnator 0.05 \
      --out out/tinyworld_serve.json"
$PY bench/tinyworld.py --merge out/tinyworld_iterate.json out/tinyworld_serve.json out/tinyworld_novel.json \
    out/tinyworld_iterate_replicate.json --out $R/tinyworld.json
both "$PY bench/tinyworld.py iterate --steps 30 --budgets 0.05 --no-sparse-system --records --no-plots --out out/tw30_iterate.json" \
     "$PY bench/tinyworld.py serve --steps 30 --budgets 0.05 --no-sparse-system --records --no-plots --out out/tw30_serve.json"
$PY bench/tinyworld.py --merge out/tw30_iterate.json out/tw30_serve.json --out $R/tinyworld_n30.json --no-plots
both "$PY bench/tinyworld.py iterate --steps 50 --budgets 0.05 --no-sparse-system --records --no-plots --out out/tw50_iterate.json" \
     "$PY bench/tinyworld.py serve --steps 50 --budgets 0.05 --no-sparse-system --records --no-plots --out out/tw50_serve.json"
$PY bench/tinyworld.py --merge out/tw50_iterate.json out/tw50_serve.json --out $R/tinyworld_n50.json --no-plots
$PY bench/studies/localization.py
# the re-noised fill of M (bench/results/studies, measured with --fill-calls 0) against today's
$PY bench/studies/depth_studies.py --instances $R/studies/renoise_fill.*-of-6.jsonl \
    --fill $R/calibration_measurements.0-of-2.jsonl $R/calibration_measurements.1-of-2.jsonl
$PY bench/studies/guided_finish_study.py
$PY bench/report.py
