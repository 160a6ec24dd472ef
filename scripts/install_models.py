"""Put the pack's bundled models where ComfyUI finds them, and their calibrations where the gate does.

    python custom_nodes/carnator/scripts/install_models.py            # from the ComfyUI folder
    python scripts/install_models.py --comfyui ~/ComfyUI              # from anywhere

Copies (never overwrites a file that differs: it says so and leaves it):

- models/tinyworld/carnator_tinyworld_wan21.safetensors (the trained tiny world, 3.6 MB) and
  models/tiny/*.safetensors (three random-weight models of real architectures, 12 MB) into
  <ComfyUI>/models/diffusion_models/, the folder of Load Diffusion Model (UNETLoader);
- models/calibration/<fingerprint>[.probe<share>][.n<steps>].json (each bundled model's calibrations, one
  per probe_fraction measured) into the default
  cache, <user directory>/carnator_cache/calibration/, so their gates run calibrated.
  A calibration you made yourself for the same model is kept.

Standard library only: it runs with any Python, before ComfyUI is started.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
from pathlib import Path

PACK = Path(__file__).resolve().parent.parent


def bundled_models() -> list[Path]:
    return [PACK / "models" / "tinyworld" / "carnator_tinyworld_wan21.safetensors",
            *sorted((PACK / "models" / "tiny").glob("*.safetensors"))]


def bundled_calibrations() -> list[Path]:
    """<fingerprint>.json (the default probe), <fingerprint>.probe<share>.json (another), each
    possibly with a .n<steps> twin measured at that N."""
    return sorted(f for f in (PACK / "models" / "calibration").glob("*.json")
                  if re.fullmatch(r"[0-9a-f]{32}(\.probe[0-9.]*[0-9])?(\.n[0-9]+)?", f.stem))


def find_comfyui(given: str | None) -> Path | None:
    """--comfyui, else COMFYUI_PATH, else the ComfyUI folder this pack sits in (custom_nodes/)."""
    for c in (given, os.environ.get("COMFYUI_PATH")):
        if c:
            return Path(c).expanduser()
    here = Path(os.path.abspath(__file__))  # not resolved: custom_nodes/carnator may be a link
    for parent in here.parents:
        if (parent / "main.py").is_file() and (parent / "custom_nodes").is_dir():
            return parent
    return None


def place(src: Path, dest_dir: Path, out: list[str]) -> None:
    dest = dest_dir / src.name
    if dest.exists():
        same = dest.resolve() == src.resolve() or filecmp.cmp(src, dest, shallow=False)
        out.append(f"  already there: {dest}" if same
                   else f"  kept yours (differs from the bundled file): {dest}")
        return
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)
    out.append(f"  copied {src.name} -> {dest}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", help="the ComfyUI folder (default: the one this pack is installed in)")
    ap.add_argument("--user-directory", help="ComfyUI's --user-directory if you start it with one "
                    "(default: <ComfyUI>/user)")
    args = ap.parse_args(argv)
    root = find_comfyui(args.comfyui)
    if root is None or not (root / "main.py").is_file():
        print(f"no ComfyUI folder found{f' at {root}' if root else ''}: pass --comfyui PATH "
              "(the folder holding main.py)", file=sys.stderr)
        return 2
    models = root / "models" / "diffusion_models"
    user = Path(args.user_directory).expanduser() if args.user_directory else root / "user"
    calibration = user / "carnator_cache" / "calibration"
    out: list[str] = [f"models -> {models}"]
    for f in bundled_models():
        place(f, models, out)
    out.append(f"calibrations -> {calibration}")
    for f in bundled_calibrations():
        place(f, calibration, out)
    print("\n".join(out))
    print("done: restart ComfyUI (or press R in the page) and drag workflows/carnator_tinyworld_sampler.json onto the canvas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
