#!/usr/bin/env bash
# The deeper recipe's tiny-world numbers (docs/results.md: probe_fraction 0.05, more steps)
# measured on one model, from its calibration to every workload (not part of CI).
# Resumable: a step whose result file exists is skipped, so rerun it (same arguments) after a
# session ends; each step runs two processes at a time (one per core).
# MODEL defaults to the bundled (language-retrained) tiny world; TAG=lang2 named its results:
#   TAG=lang2 bash scripts/deeper_recipe_results.sh    # calibration ~85 min, N = 20 ~45 min, N = 30
#        # and 50 ~80 min, EasyCache'd model's calibration ~85 min and its sweeps ~30 min, the N = 30
#        # calibration ~55 min and its four workloads ~40 min, the N = 50 calibration ~80 min and
#        # its two workloads ~18 min (2 cores)
# Writes bench/results/studies/${TAG}_region4_calibration/ (measurements, the joint fit, the
# calibration file the benchmarks load) and bench/results/studies/tinyworld_${TAG}_region4_*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-models/tinyworld/carnator_tinyworld_wan21.safetensors}
TAG=${TAG:?name the results, e.g. TAG=lang2}
S=bench/results/studies
CAL=$S/${TAG}_region4_calibration
SCRATCH=${SCRATCH:-out/${TAG}_cache}
both() {  # run two commands in parallel; fail if either fails
  bash -c "$1" & local a=$!
  bash -c "$2" & local b=$!
  wait "$a" && wait "$b"
}
skip_or() { if [ -f "$1" ]; then echo "[deeper] have $1" >&2; echo true; else echo "$2"; fi; }

# 1. the calibration pairs measured with the recipe: 1-step probe, M filled on its own tokens and
#    widened by a tile, the 4-call region finish for edits, the 4-call guided finish for same-scene;
# 2. then one threshold per evidence class, certified by Learn-then-Test on the gate's choice
calibrate() {  # results folder, scratch name, extra arguments (the same for the shards and the fit)
  local dir=$1 name=$2; shift 2
  local recipe="--model $MODEL --probe-fraction 0.05 --fill-on-m --region-margin 1 --other-finish-calls 4 \
--other-finish-region --threads 1 --results $dir $*"
  both "$(skip_or "$dir/calibration_measurements.0-of-2.jsonl" "$PY bench/calibrate.py $recipe --shard 0/2 --cache $SCRATCH/${name}0")" \
       "$(skip_or "$dir/calibration_measurements.1-of-2.jsonl" "$PY bench/calibrate.py $recipe --shard 1/2 --cache $SCRATCH/${name}1")"
  $PY bench/calibrate.py --model "$MODEL" --probe-fraction 0.05 --form signed --joint --results "$dir" "$@" \
      --cache "$SCRATCH/${name}fit" --instances "$dir"/calibration_measurements.{0,1}-of-2.jsonl
}
calibrate "$CAL" ""
RISK=$(ls "$CAL"/calibration/*.probe0.05.json)

# 3. the workloads at N = 20, every budget (serve_reworded: serve in phrasings nobody trained or
#    calibrated on); then N = 30 and 50 (the 20-step calibration carried over by depth shares:
#    no stated guarantee there). Two at a time, in this order.
run() {  # workload steps
  local out=$S/tinyworld_${TAG}_region4_$1$([ "$2" = 20 ] || echo "_n$2").json
  skip_or "$out" "$PY bench/tinyworld.py $1 --model $MODEL --steps $2 --probe-fraction 0.05 \
--budgets 0.02 0.05 0.1 --no-sparse-system --records --no-plots --threads 1 --risk-model $RISK --out $out"
}
for job in "serve 20" "iterate 20" "serve_reworded 20" "novel 20" "iterate_replicate 20" \
           "serve 30" "iterate 30" "serve 50" "iterate 50"; do
  run $job
done | xargs -d '\n' -P 2 -I{} bash -c {}

# 4. against ComfyUI's EasyCache: EasyCache alone swept over its threshold beside Carnator, then
#    Carnator on the EasyCache'd model with that model's own calibration (EasyCache changes the
#    fingerprint, and its error adds to the reuse's), read at matched PSNR by compose_report
SWEEP="--model $MODEL --probe-fraction 0.05 --budgets 0.05 --no-sparse-system --records --no-plots --threads 1"
CAL_E=$S/${TAG}_region4_easycache_calibration
calibrate "$CAL_E" e --easycache 0.02
for wl in serve iterate; do
  out=$S/tinyworld_${TAG}_region4_easycache_$wl.json
  skip_or "$out" "$PY bench/tinyworld.py $wl $SWEEP --risk-model $RISK --easycache 0.02 0.03 0.05 0.08 0.1 0.2 \
--easycache-carnator 0.02 --easycache-risk-model $CAL_E/calibration --out $out"
done | xargs -d '\n' -P 2 -I{} bash -c {}
$PY bench/compose_report.py $S/tinyworld_${TAG}_region4_{serve,iterate}.json \
    $S/tinyworld_${TAG}_region4_easycache_{serve,iterate}.json --out $S/easycache_compute_${TAG}_region4.json --no-plots

# 5. a calibration measured at N = 30 — the region finish keeps its share of the trajectory (6 calls
#    span the last 12 of 30 steps as 4 span 8 of 20; the same-scene finish keeps its 4 calls, as the
#    gate ran them at N = 30 on the 20-step calibration) — and the workloads at N = 30 with it
CAL30=$S/${TAG}_region4_n30_calibration
calibrate "$CAL30" n30 --steps 30 --other-finish-calls 6
RISK30=$(ls "$CAL30"/calibration/*.probe0.05.json)
for wl in serve iterate novel iterate_replicate; do
  out=$S/tinyworld_${TAG}_region4_${wl}_n30_cal30.json
  skip_or "$out" "$PY bench/tinyworld.py $wl --model $MODEL --steps 30 --probe-fraction 0.05 \
--budgets 0.02 0.05 0.1 --no-sparse-system --records --no-plots --threads 1 --risk-model $RISK30 --out $out"
done | xargs -d '\n' -P 2 -I{} bash -c {}
# 6. the same at N = 50 (10 region-finish calls span the last 20 of 50 steps), `serve` and `iterate`
CAL50=$S/${TAG}_region4_n50_calibration
calibrate "$CAL50" n50 --steps 50 --other-finish-calls 10
RISK50=$(ls "$CAL50"/calibration/*.probe0.05.json)
for wl in serve iterate; do
  out=$S/tinyworld_${TAG}_region4_${wl}_n50_cal50.json
  skip_or "$out" "$PY bench/tinyworld.py $wl --model $MODEL --steps 50 --probe-fraction 0.05 \
--budgets 0.02 0.05 0.1 --no-sparse-system --records --no-plots --threads 1 --risk-model $RISK50 --out $out"
done | xargs -d '\n' -P 2 -I{} bash -c {}
echo "[deeper] done: $CAL, $CAL_E, $CAL30, $CAL50 and $S/{tinyworld,easycache_compute}_${TAG}_region4*.json"
