#!/usr/bin/env bash
# The retraining of the tiny world on the broad language, as one resumable recipe:
# rerun it (same arguments) until it says the chain is done; each run trains for MINUTES.
#   stage A: the caption-trained model fine-tuned on half broad-language captions to 6,000 steps
#            (models/tinyworld_broad/);
#   stage B: from stage A's checkpoint, the phrase-consistency loss (--consistency 20) to
#            21,124 steps (models/tinyworld_inv/), where more steps stopped closing the gap;
#   stage C: from there, the same on tinyworld.language's revision 2 (more training families,
#            --language broad2) to STEPS_C steps (models/tinyworld_lang2/).
# The directories are ignored by git. `KEEP=1` (at the end of a session) copies the newest
# checkpoint (weights + EMA and its ckpt.json, not the AdamW moments) to the committed
# models/tinyworld/ (the bundled tiny world is this chain's stage C, step 24,476), and a new
# checkout resumes from there (fresh AdamW moments).
# Export and measure:  .venv/bin/python scripts/train_tinyworld.py --dir models/tinyworld_lang2 --export
#   .venv/bin/python bench/studies/phrasing.py --model models/tinyworld_lang2/carnator_tinyworld_wan21.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
THREADS=${THREADS:-2}
MINUTES=${MINUTES:-60}
STEPS_A=6000
STEPS_B=21124
STEPS_C=${STEPS_C:-40000}
A=models/tinyworld_broad
B=models/tinyworld_inv
C=models/tinyworld_lang2
COMMON=(--broad-share 0.5 --lr 2e-4 --warmup 100 --p-shift 0.3 --p-high 0
        --objects 0 --seed 3 --edge-weight 6 --obj-weight 3 --batch 32 --bank 6144
        --threads "$THREADS" --ckpt-every 240 --resume)
KEPT=models/tinyworld
deadline=$(( $(date +%s) + ${MINUTES%.*} * 60 ))
step_of() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$1/ckpt.json" 2>/dev/null || echo 0; }
left() { echo $(( (deadline - $(date +%s)) / 60 )); }
stage_of() { "$PY" -c "import json,sys; r = json.load(open(sys.argv[1]))['recipe']
print('C' if r.get('language') == 'broad2' else 'B' if r.get('consistency', 0) > 0 else 'A')" "$1/ckpt.json"; }

if [ "${KEEP:-0}" = 1 ]; then
  src=$A; [ -f "$B/ckpt.json" ] && src=$B; [ -f "$C/ckpt.json" ] && src=$C
  [ -f "$src/ckpt.json" ] || { echo "[retrain] nothing to keep"; exit 1; }
  mkdir -p "$KEPT" && cp "$src/ckpt.safetensors" "$src/ckpt.json" "$KEPT"/
  echo "[retrain] kept stage $(stage_of "$KEPT") at step $(step_of "$KEPT") in $KEPT"; exit 0
fi
# a new checkout: resume from the kept checkpoint, in the stage it was taken from
if [ ! -f "$A/ckpt.json" ] && [ ! -f "$B/ckpt.json" ] && [ ! -f "$C/ckpt.json" ] && [ -f "$KEPT/ckpt.json" ]; then
  dst=$A; [ "$(stage_of "$KEPT")" = B ] && dst=$B; [ "$(stage_of "$KEPT")" = C ] && dst=$C
  mkdir -p "$dst" && cp "$KEPT/ckpt.safetensors" "$KEPT/ckpt.json" "$dst"/
  echo "[retrain] resuming from the kept checkpoint (stage $(stage_of "$KEPT"), step $(step_of "$KEPT"))"
  COMMON+=(--rewarm 100)  # fresh AdamW moments: warm the lr up again
fi

copy_ckpt() { mkdir -p "$2"; cp "$1"/ckpt.safetensors "$1"/ckpt.json "$2"/
  if [ -f "$1/ckpt_optim.safetensors" ]; then cp "$1/ckpt_optim.safetensors" "$2"/; fi; }
if [ ! -f "$B/ckpt.json" ] && [ ! -f "$C/ckpt.json" ]; then
  if [ "$(step_of "$A")" -lt "$STEPS_A" ]; then
    echo "[retrain] stage A: broad fine-tune to $STEPS_A steps (now $(step_of "$A"))"
    "$PY" scripts/train_tinyworld.py --dir "$A" --init-from models/tinyworld_caption/carnator_tinyworld_wan21.safetensors \
        --language broad "${COMMON[@]}" --steps "$STEPS_A" --minutes "$(left)"
  fi
  if [ "$(step_of "$A")" -lt "$STEPS_A" ]; then
    echo "[retrain] stage A stopped at step $(step_of "$A"); run again to go on"; exit 0
  fi
  copy_ckpt "$A" "$B"
fi
if [ ! -f "$C/ckpt.json" ]; then
  if [ "$(step_of "$B")" -lt "$STEPS_B" ]; then
    if [ "$(left)" -lt 2 ]; then echo "[retrain] out of time before stage B"; exit 0; fi
    echo "[retrain] stage B: phrase consistency to $STEPS_B steps (now $(step_of "$B"))"
    "$PY" scripts/train_tinyworld.py --dir "$B" --language broad "${COMMON[@]}" --consistency 20 \
        --steps "$STEPS_B" --minutes "$(left)"
  fi
  if [ "$(step_of "$B")" -lt "$STEPS_B" ]; then
    echo "[retrain] stage B stopped at step $(step_of "$B"); run again to go on"; exit 0
  fi
  copy_ckpt "$B" "$C"
fi
if [ "$(left)" -lt 2 ]; then echo "[retrain] out of time before stage C"; exit 0; fi
echo "[retrain] stage C: revision 2 of the language to $STEPS_C steps (now $(step_of "$C"))"
"$PY" scripts/train_tinyworld.py --dir "$C" --language broad2 "${COMMON[@]}" --consistency 20 \
    --steps "$STEPS_C" --minutes "$(left)"
if [ "$(step_of "$C")" -ge "$STEPS_C" ]; then echo "[retrain] chain done at step $(step_of "$C")"
else echo "[retrain] stage C stopped at step $(step_of "$C"); run again to go on"; fi
