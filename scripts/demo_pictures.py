"""The demo's outcome as pictures: the trained tiny-world model, four requests, docs/demo/.

    python scripts/demo_pictures.py             # writes docs/demo/*.png (part of `make demo`)
    python scripts/demo_pictures.py --check     # regenerates into a temp folder, compares bytes

One request after another through Carnator's own request path (``comfy_adapter.run_request``,
what the Carnator Sampler node runs), on the bundled tiny-world model loaded by ComfyUI's own
loader, in a fresh cache holding the model's shipped calibration (α = 5%):

  1. MISS   "a red circle in the top left moves right"        computed in full, stored
  2. HIT    a paraphrase of it                                   same scene: resumed deep, M empty
  3. HIT    the same scene with a blue square added              M (outlined) recomputed around it
  4. EXACT  request 1 again                                      returned from the cache, 0 steps

Each request's picture shows its four frames (the tiny world's latent is an exact pixel
transform, so these are the real frames, as the node's preview shows them) and, for a hit,
the stored entry it reused. One overview (docs/demo/carnator-demo.png, the README's first
picture) and one strip per request. Deterministic: CPU, one thread, fixed seed; the bytes are
the same on every run and machine with the pinned torch and Pillow (`--check` says so).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "demo"
MODEL = ROOT / "models" / "tinyworld" / "carnator_tinyworld_wan21.safetensors"
SEED, STEPS, CFG, BUDGET = 42, 20, 4.0, 0.05
BASE = "a red circle in the top left moves right"
REQUESTS = [  # (file name, what it shows, prompt)
    ("1-miss", "first request", BASE),
    ("2-hit-paraphrase", "a paraphrase", "a scarlet ball at the top left travels right"),
    ("3-hit-edit", "an object added",
     "a red circle in the top left moves right and a blue square in the bottom right moves up"),
    ("4-exact", "the first request again", BASE),
]
FRAME_PX = 96          # each 32×32 frame enlarged 3× (nearest)
GAP, MARGIN, TEXT_H = 6, 12, 34
COLOURS = {"miss": (183, 121, 31), "hit": (46, 158, 91), "exact": (58, 123, 213)}
BACKGROUND, INK, MUTED = (24, 24, 27), (235, 235, 235), (160, 160, 168)


def run_requests(cache_dir: Path) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    from comfy_host import import_comfy
    import_comfy()
    import torch
    torch.set_num_threads(1)  # one thread: the same float sums on every machine
    import comfy.sd
    from carnator_core.comfy_adapter import TINYWORLD_LATENT_FORMAT, mark_latent_format, run_request
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings, open_cache
    from tinyworld import latent as LAT
    from tinyworld import text as TXT

    (cache_dir / "calibration").mkdir(parents=True)
    from install_models import bundled_calibrations  # beside this script: what a user installs
    for f in bundled_calibrations():
        shutil.copy(f, cache_dir / "calibration" / f.name)
    model = comfy.sd.load_diffusion_model(str(MODEL))
    cond = lambda text: mark_latent_format(TXT.conditioning(text), TINYWORLD_LATENT_FORMAT)  # noqa: E731
    negative = cond("")
    settings = ReuseSettings(gate=GateSettings(risk_budget=BUDGET))
    out = []
    for name, what, prompt in REQUESTS:
        latent = {"samples": torch.zeros(1, 16, 4, 16, 16)}
        samples, s = run_request(model, cond(prompt), negative, latent, SEED, STEPS, CFG, "euler",
                                 "simple", settings, {"folder": str(cache_dir)}, label=prompt)
        cache, _ = open_cache(str(cache_dir), 8 * 1024**3)
        source = cache.load_tensors(s.entry_id, ["final"])["final"] if s.entry_id else None
        region = None
        if s.outcome == "hit" and s.stored_id:
            region = (cache.load_tensors(s.stored_id, ["region"]) or {}).get("region")
        frames = lambda x: LAT.decode_comfy(x.float(), clamp=True)[0].permute(1, 2, 3, 0)  # noqa: E731
        out.append({"name": name, "what": what, "prompt": prompt, "summary": s,
                    "frames": frames(samples), "source": None if source is None else frames(source),
                    "region": region})
        print(f"{name:18} {s.outcome.upper():5} k*={s.reuse_step} steps {s.steps_computed}/{s.steps_total}"
              f" M={s.region_fraction}  {prompt}", flush=True)
    return out


def headline(r: dict) -> str:
    s = r["summary"]
    if s.outcome == "hit":
        m = f"region M {s.region_fraction:.0%} recomputed" if s.region_fraction else "M empty"
        return f"HIT  k*={s.reuse_step}/{s.steps_total} · {s.steps_computed}/{s.steps_total} steps computed · {m}"
    if s.outcome == "exact":
        return f"EXACT  0/{s.steps_total} steps computed · the stored result"
    return f"MISS  {s.steps_computed}/{s.steps_total} steps computed · stored"


def render(results: list[dict], out: Path) -> list[Path]:
    import torch
    from PIL import Image, ImageDraw, ImageFont
    from carnator_core.preview import frame_strip

    font = ImageFont.load_default()
    strip_w = FRAME_PX * 4 + GAP * 3
    rows = []
    for r in results:
        request = frame_strip(r["frames"], r["region"], 4, FRAME_PX, GAP)
        source = frame_strip(r["source"], None, 4, FRAME_PX, GAP) if r["source"] is not None else None
        w = MARGIN * 3 + strip_w * 2
        h = MARGIN + TEXT_H + request.shape[0] + 18 + MARGIN
        img = Image.new("RGB", (w, h), BACKGROUND)
        d = ImageDraw.Draw(img)
        s = r["summary"]
        d.rectangle([MARGIN, MARGIN, MARGIN + 6, MARGIN + TEXT_H - 8], fill=COLOURS[s.outcome])
        d.text((MARGIN + 14, MARGIN), headline(r), fill=INK, font=font)
        d.text((MARGIN + 14, MARGIN + 15), f"{r['what']}: “{r['prompt']}”", fill=MUTED, font=font)
        y = MARGIN + TEXT_H
        if s.outcome == "exact":  # the answer is the stored entry itself
            img.paste(Image.fromarray(source.numpy(), "RGB"), (MARGIN, y))
            d.text((MARGIN, y + request.shape[0] + 3), "returned from the cache (entry of request 1)", fill=MUTED, font=font)
        else:
            img.paste(Image.fromarray(request.numpy(), "RGB"), (MARGIN, y))
            label = "this request" + (" · white: region M, computed anew" if r["region"] is not None
                                      and bool(r["region"].any()) else "")
            d.text((MARGIN, y + request.shape[0] + 3), label, fill=MUTED, font=font)
        if s.outcome == "hit":
            x = MARGIN * 2 + strip_w
            img.paste(Image.fromarray(source.numpy(), "RGB"), (x, y))
            d.text((x, y + request.shape[0] + 3), f"the stored entry it reused (request 1), resumed at step {s.reuse_step}",
                   fill=MUTED, font=font)
        rows.append(img)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for r, img in zip(results, rows):
        path = out / f"{r['name']}.png"
        img.save(path, format="PNG", optimize=False)
        written.append(path)
    overview = Image.new("RGB", (max(i.width for i in rows), sum(i.height for i in rows)), BACKGROUND)
    y = 0
    for img in rows:
        overview.paste(img, (0, y))
        y += img.height
    overview.save(out / "carnator-demo.png", format="PNG", optimize=False)
    written.append(out / "carnator-demo.png")
    (out / "demo.json").write_text(json.dumps([{
        "request": r["name"], "prompt": r["prompt"], "outcome": r["summary"].outcome,
        "reuse_step": r["summary"].reuse_step, "steps_computed": r["summary"].steps_computed,
        "steps_total": r["summary"].steps_total, "region_fraction": r["summary"].region_fraction}
        for r in results], indent=1) + "\n")
    written.append(out / "demo.json")
    del torch
    return written


def pixels_apart(a: Path, b: Path, most: float = 0.001) -> float | None:
    """The share of two pictures' 8-bit values that differ, when none differs by more than one
    level and at most ``most`` of them differ; else None."""
    import numpy as np
    from PIL import Image
    x, y = (np.asarray(Image.open(p)).astype(int) for p in (a, b))
    if x.shape != y.shape:
        return None
    d = np.abs(x - y)
    share = float((d > 0).mean())
    return share if d.max() <= 1 and share <= most else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--check", action="store_true",
                    help=f"regenerate into a temporary folder and compare with {OUT.relative_to(ROOT)}")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_requests(Path(tmp) / "cache")
        out = Path(tmp) / "out" if args.check else Path(args.out)
        written = render(results, out)
        if args.check:
            if not OUT.is_dir():
                print("differ from docs/demo/: ['(no docs/demo/)']")
                return 1
            differ = [p.name for p in written if (OUT / p.name).read_bytes() != p.read_bytes()]
            if not differ:
                print("identical to docs/demo/")
                return 0
            apart = {name: pixels_apart(OUT / name, Path(tmp) / "out" / name) if name.endswith(".png") else None
                     for name in differ}  # a record that differs is a different result, not rounding
            if all(a is not None for a in apart.values()):
                # another CPU's vector kernels may round a value the other way: one 8-bit level
                # on a few pixels, never more
                print("identical to docs/demo/ but for rounding: "
                      + ", ".join(f"{n} {a:.3%} of its values one level apart" for n, a in apart.items()))
                return 0
            print(f"differ from docs/demo/: {differ}")
            return 1
    for p in written:
        print("wrote", p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
