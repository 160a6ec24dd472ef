#!/usr/bin/env bash
# Issue 13's retraining of the tiny world on the broad language, as one resumable recipe:
# rerun it (same arguments) until it says the chain is done; each run trains for MINUTES.
#   stage A: the committed model fine-tuned on half broad-language captions to 6,000 steps
#            (models/tinyworld_broad/);
#   stage B: from stage A's checkpoint, the phrase-consistency loss (--consistency 20) to
#            STEPS_B steps (models/tinyworld_inv/).
# Both directories are ignored by git. `KEEP=1` (at the end of a session) copies the newest
# checkpoint (weights + EMA and its ckpt.json, not the AdamW moments) to the committed
# models/tinyworld_language/, and a new checkout resumes from there (fresh AdamW moments).
# Export and measure:  .venv/bin/python scripts/train_tinyworld.py --dir models/tinyworld_inv --export
#   .venv/bin/python bench/phrasing.py --model models/tinyworld_inv/carnator_tinyworld_wan21.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
THREADS=${THREADS:-2}
MINUTES=${MINUTES:-60}
STEPS_A=6000
STEPS_B=${STEPS_B:-30000}
A=models/tinyworld_broad
B=models/tinyworld_inv
COMMON=(--language broad --broad-share 0.5 --lr 2e-4 --warmup 100 --p-shift 0.3 --p-high 0
        --objects 0 --seed 3 --edge-weight 6 --obj-weight 3 --batch 32 --bank 6144
        --threads "$THREADS" --ckpt-every 240 --resume)
KEPT=models/tinyworld_language
deadline=$(( $(date +%s) + ${MINUTES%.*} * 60 ))
step_of() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$1/ckpt.json" 2>/dev/null || echo 0; }
left() { echo $(( (deadline - $(date +%s)) / 60 )); }
stage_of() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['recipe'].get('consistency', 0) > 0 and 'B' or 'A')" "$1/ckpt.json"; }

if [ "${KEEP:-0}" = 1 ]; then
  src=$A; [ -f "$B/ckpt.json" ] && src=$B
  [ -f "$src/ckpt.json" ] || { echo "[retrain] nothing to keep"; exit 1; }
  mkdir -p "$KEPT" && cp "$src/ckpt.safetensors" "$src/ckpt.json" "$KEPT"/
  echo "[retrain] kept stage $(stage_of "$KEPT") at step $(step_of "$KEPT") in $KEPT"; exit 0
fi
# a new checkout: resume from the kept checkpoint, in the stage it was taken from
if [ ! -f "$A/ckpt.json" ] && [ ! -f "$B/ckpt.json" ] && [ -f "$KEPT/ckpt.json" ]; then
  dst=$A; [ "$(stage_of "$KEPT")" = B ] && dst=$B
  mkdir -p "$dst" && cp "$KEPT/ckpt.safetensors" "$KEPT/ckpt.json" "$dst"/
  echo "[retrain] resuming from the kept checkpoint (stage $(stage_of "$KEPT"), step $(step_of "$KEPT"))"
  COMMON+=(--rewarm 100)  # fresh AdamW moments: warm the lr up again
fi

if [ ! -f "$B/ckpt.json" ]; then
  if [ "$(step_of "$A")" -lt "$STEPS_A" ]; then
    echo "[retrain] stage A: broad fine-tune to $STEPS_A steps (now $(step_of "$A"))"
    "$PY" scripts/train_tinyworld.py --dir "$A" --init-from models/tinyworld/carnator_tinyworld_wan21.safetensors \
        "${COMMON[@]}" --steps "$STEPS_A" --minutes "$(left)"
  fi
  if [ "$(step_of "$A")" -lt "$STEPS_A" ]; then
    echo "[retrain] stage A stopped at step $(step_of "$A"); run again to go on"; exit 0
  fi
  mkdir -p "$B"
  cp "$A"/ckpt.safetensors "$A"/ckpt.json "$B"/
  [ -f "$A/ckpt_optim.safetensors" ] && cp "$A/ckpt_optim.safetensors" "$B"/
fi
if [ "$(left)" -lt 2 ]; then echo "[retrain] out of time before stage B"; exit 0; fi
echo "[retrain] stage B: phrase consistency to $STEPS_B steps (now $(step_of "$B"))"
"$PY" scripts/train_tinyworld.py --dir "$B" "${COMMON[@]}" --consistency 20 --steps "$STEPS_B" --minutes "$(left)"
if [ "$(step_of "$B")" -ge "$STEPS_B" ]; then echo "[retrain] chain done at step $(step_of "$B")"
else echo "[retrain] stage B stopped at step $(step_of "$B"); run again to go on"; fi
