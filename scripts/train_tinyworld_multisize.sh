#!/usr/bin/env bash
# The multi-size tiny world: the bundled model (models/tinyworld/) fine-tuned on every size of
# tinyworld.world.SIZES (2, 4, 6, 8 frames x 16, 32, 48 px), one size per batch in turn, on
# the bundled model's own training mix (revision 2 of the broad language, phrase consistency).
# Resumable: rerun it (same arguments) until it says it is done; each run trains for MINUTES.
#   bash scripts/train_tinyworld_multisize.sh                     # THREADS=1 MINUTES=600 by default
#   nohup bash scripts/train_tinyworld_multisize.sh > /tmp/multisize_train.log 2>&1 &
# phase A: lr 2e-4 to STEPS_A steps; phase B: lr 1e-4 to STEPS_B steps; then the export.
# Writes into models/tinyworld_multisize/: ckpt.safetensors (weights + EMA, float32),
# ckpt_optim.safetensors (AdamW moments), ckpt.json (step, recipe) every CKPT_EVERY seconds
# (5 minutes), and carnator_tinyworld_wan21.safetensors (the EMA weights in float16, what
# ComfyUI loads) at the end of each run. After a stop without the export:
#   .venv/bin/python scripts/train_tinyworld.py --dir models/tinyworld_multisize --export
# Measure at a size:
#   .venv/bin/python scripts/train_tinyworld.py --eval 64 --eval-size 8x48 \
#       --model models/tinyworld_multisize/carnator_tinyworld_wan21.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DIR=${DIR:-models/tinyworld_multisize}
THREADS=${THREADS:-1}
MINUTES=${MINUTES:-600}
STEPS_A=${STEPS_A:-6000}
STEPS_B=${STEPS_B:-8000}
CKPT_EVERY=${CKPT_EVERY:-300}
FROM=models/tinyworld/carnator_tinyworld_wan21.safetensors
COMMON=(--dir "$DIR" --resume --init-from "$FROM" --sizes all --size-order cycle
        --language broad2 --broad-share 0.5 --consistency 20 --warmup 100 --p-shift 0.3 --p-high 0
        --objects 0 --seed 5 --edge-weight 6 --obj-weight 3 --batch 32 --bank 6144
        --threads "$THREADS" --ckpt-every "$CKPT_EVERY" --log-every 120)
deadline=$(( $(date +%s) + ${MINUTES%.*} * 60 ))
step_of() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$1/ckpt.json" 2>/dev/null || echo 0; }
left() { echo $(( (deadline - $(date +%s)) / 60 )); }
export_model() { "$PY" scripts/train_tinyworld.py --dir "$DIR" --export; }

if [ "$(step_of "$DIR")" -lt "$STEPS_A" ]; then
  echo "[multisize] phase A: lr 2e-4 to $STEPS_A steps (now $(step_of "$DIR"))"
  "$PY" scripts/train_tinyworld.py "${COMMON[@]}" --lr 2e-4 --steps "$STEPS_A" --minutes "$(left)"
fi
if [ "$(step_of "$DIR")" -lt "$STEPS_A" ]; then
  export_model; echo "[multisize] phase A stopped at step $(step_of "$DIR"); run again to go on"; exit 0
fi
if [ "$(left)" -ge 2 ] && [ "$(step_of "$DIR")" -lt "$STEPS_B" ]; then
  echo "[multisize] phase B: lr 1e-4 to $STEPS_B steps (now $(step_of "$DIR"))"
  "$PY" scripts/train_tinyworld.py "${COMMON[@]}" --lr 1e-4 --rewarm 20 --steps "$STEPS_B" --minutes "$(left)"
fi
export_model
if [ "$(step_of "$DIR")" -ge "$STEPS_B" ]; then echo "[multisize] done at step $(step_of "$DIR")"
else echo "[multisize] phase B stopped at step $(step_of "$DIR"); run again to go on"; fi
