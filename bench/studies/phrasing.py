"""Does the tiny-world model follow how people write?

    nice -n 10 .venv/bin/python bench/studies/phrasing.py                  # 120 scenes, ~7 min on one core
    .venv/bin/python bench/studies/phrasing.py --scenes 5 --out /tmp/p.json  # a quick look

For N scenes (alternately one and two objects), each with its own seed, every phrasing below
is computed in full on the model (ComfyUI's sampler through bench/tinyworld.py's ``World``,
the benchmark's reference path: 20 steps, cfg 4, euler, same_seed) and judged by the checker
against the scene -- never by reading the prompt:

- ``canonical``  ``world.caption(scene, canonical=True)``;
- ``caption``    a ``world.caption()`` paraphrase: the language the caption-trained model was trained on;
- ``training``   K distinct phrasings from the training families of the language's revision 1
                 (``TRAIN_FAMILIES_REVISION_1``; --training, as many as held-out ones: the gap to
                 training compares like with like). Revision 2 added training families; drawing
                 from revision 1 keeps every prompt -- held-out ones included, drawn from the
                 same stream -- what earlier runs measured, so runs stay comparable;
- ``held_out``   K distinct phrasings from ``HELD_OUT_FAMILIES``: structures a model trained
                 with ``--language broad`` never saw.

Same scene and seed, different phrasings should give the same video: the share of pairs of
held-out phrasings of one scene whose videos are within --psnr-bound (30 dB), and of each
phrasing against the canonical caption's video.

Writes bench/results/phrasing.json: ``held_out_phrasing_all_right`` (share of held-out
prompts with every attribute of every object right, the key figure) with
``held_out_phrasing_per_attribute`` beside it (share of prompts with that attribute right for
every object, and the object count), the same for the training, caption() and canonical
rows, the pair shares, the language targets with pass/fail, per-family and per-object-count
figures, every prompt's record, the model and the command.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (os.path.join(REPO, "tests"), REPO):  # REPO first: the tinyworld package, not bench/tinyworld.py
    if p in sys.path:
        sys.path.remove(p)
    sys.path.insert(0, p)
BENCH = os.path.join(REPO, "bench")
if BENCH not in sys.path:  # last: bench/tinyworld.py is no package
    sys.path.append(BENCH)

from calibrate import _load_bench  # noqa: E402
from carnator_core.calibration.risk_control import clopper_pearson_lower, clopper_pearson_upper  # noqa: E402

ROWS = ("canonical", "caption", "training", "held_out")
ATTRS = ("shape", "colour", "position", "motion", "count")
TARGETS = {"held_out_all_right_min": 0.90, "held_out_per_attribute_min": 0.95,
           "gap_to_training_max": 0.03, "held_out_pairs_within_bound_min": 0.80}


def measured_training_families() -> tuple[str, ...]:
    """The training families the ``training`` row draws from: revision 1's, so every prompt
    (held-out ones too, drawn from the same stream) stays the one earlier runs measured."""
    from tinyworld import language as LANG
    return LANG.TRAIN_FAMILIES_REVISION_1


def prompts_for(scene: dict, rng: random.Random, held_out: int, training: int = 1) -> list[dict]:
    """The scene's prompts: canonical, a caption() paraphrase, ``training`` distinct
    training-family phrasings and ``held_out`` distinct held-out-family phrasings (with the
    families each used). The training phrasings after the first are drawn last, so the first
    and the held-out ones are the same whatever ``training`` is."""
    from tinyworld import language as LANG
    from tinyworld import world as WD
    train = LANG.compose(scene, rng, measured_training_families())
    out = [{"row": "canonical", "prompt": WD.caption(scene, canonical=True)},
           {"row": "caption", "prompt": WD.caption(scene, rng)},
           {"row": "training", "prompt": train.text, "families": train.families}]
    seen: set[str] = set()
    for _ in range(100 * held_out):
        if len(seen) == held_out:
            break
        got = LANG.compose(scene, rng, LANG.HELD_OUT_FAMILIES)
        if got.text not in seen:
            seen.add(got.text)
            out.append({"row": "held_out", "prompt": got.text, "families": got.families})
    if len(seen) < held_out:
        raise RuntimeError(f"only {len(seen)} distinct held-out phrasings of {scene} in {100 * held_out} draws")
    told = {train.text}
    for _ in range(100 * training):
        if len(told) >= training:
            break
        got = LANG.compose(scene, rng, measured_training_families())
        if got.text not in told:
            told.add(got.text)
            out.append({"row": "training", "prompt": got.text, "families": got.families})
    return out


def scenes_and_seeds(n: int, seed: int) -> list[tuple[dict, int]]:
    from tinyworld import world as WD
    rng = random.Random(seed)
    return [(WD.random_scene(rng, 1 + i % 2), rng.randrange(2 ** 31)) for i in range(n)]


def share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def summary(recs: list[dict]) -> dict:
    """all_right with its two-sided 95% Clopper-Pearson interval, per-attribute shares
    (prompt level: right for every object), and all_right by object count."""
    k, n = sum(r["ok"] for r in recs), len(recs)
    by_n = {str(c): share([r["ok"] for r in recs if r["objects"] == c]) for c in (1, 2)}
    return {"n": n, "all_right": k / n if n else None,
            "all_right_ci95": [clopper_pearson_lower(k, n, 0.025), clopper_pearson_upper(k, n, 0.025)] if n else None,
            "per_attribute": {a: share([r["attrs"][a] >= 1.0 for r in recs]) for a in ATTRS},
            "all_right_by_objects": by_n}


def by_family(recs: list[dict]) -> dict:
    """Held-out all_right per family (a prompt counts for each family it used)."""
    groups: dict[str, list[bool]] = {}
    for r in recs:
        fams = r["families"]
        names = list(fams["clause"]) + [fams[k] for k in ("joiner", "frame", "surface") if fams[k]]
        if not fams["frame"]:
            names.append("frame.none")
        for f in dict.fromkeys(names):
            groups.setdefault(f, []).append(r["ok"])
    return {f: {"n": len(v), "all_right": share(v)} for f, v in sorted(groups.items())}


def pair_stats(values: list[float], bound: float) -> dict:
    return {"n": len(values), "bound_db": bound, "within_bound": share([v >= bound for v in values]),
            "psnr_median": statistics.median(values) if values else None}


def measure(world, bench, scenes, held_out: int, phrase_seed: int, log_every: int = 10,
            training: int = 1) -> tuple[list, dict]:
    """Every scene's prompts computed and checked; returns (records, PSNR lists)."""
    recs: list[dict] = []
    psnrs = {"held_out_pairs": [], "held_out_vs_canonical": [], "caption_vs_canonical": [],
             "training_vs_canonical": []}
    t0 = time.time()
    for i, (scene, seed) in enumerate(scenes):
        rng = random.Random(phrase_seed * 1_000_003 + i)
        videos: dict[str, object] = {}
        mine = []
        for p in prompts_for(scene, rng, held_out, training):
            if p["prompt"] not in videos:
                run = world.new_run(p["prompt"], seed, "same_seed")
                videos[p["prompt"]] = world.video(run.sample(0, run.steps, None))
            attrs: dict = {}
            ok = bench.check_ok(videos[p["prompt"]], scene, attrs)
            mine.append({"scene": i, "seed": seed, "objects": len(scene["objects"]), **p, "ok": ok,
                         "attrs": attrs})
        canon = videos[mine[0]["prompt"]]
        held = [r["prompt"] for r in mine if r["row"] == "held_out"]
        psnrs["held_out_pairs"] += [bench.psnr(videos[a], videos[b]) for a, b in itertools.combinations(held, 2)]
        psnrs["held_out_vs_canonical"] += [bench.psnr(videos[a], canon) for a in held]
        for row in ("caption", "training"):
            psnrs[f"{row}_vs_canonical"] += [bench.psnr(videos[r["prompt"]], canon) for r in mine if r["row"] == row]
        recs += mine
        if log_every and ((i + 1) % log_every == 0 or i + 1 == len(scenes)):
            ok = {row: share([r["ok"] for r in recs if r["row"] == row]) for row in ROWS}
            print(f"{i + 1}/{len(scenes)} scenes {time.time() - t0:.0f}s  all right: "
                  + "  ".join(f"{row} {v:.3f}" for row, v in ok.items()), flush=True)
    return recs, psnrs


def results_of(recs: list[dict], psnrs: dict, bound: float) -> dict:
    rows = {row: summary([r for r in recs if r["row"] == row]) for row in ROWS}
    pairs = {k: pair_stats(v, bound) for k, v in psnrs.items()}
    held, train = rows["held_out"], rows["training"]
    gap = train["all_right"] - held["all_right"]
    targets = {
        "held_out_all_right": {"min": TARGETS["held_out_all_right_min"], "value": held["all_right"],
                               "pass": held["all_right"] >= TARGETS["held_out_all_right_min"]},
        "held_out_per_attribute": {"min": TARGETS["held_out_per_attribute_min"],
                                   "value": min(held["per_attribute"].values()),
                                   "pass": min(held["per_attribute"].values())
                                   >= TARGETS["held_out_per_attribute_min"]},
        "gap_to_training": {"max": TARGETS["gap_to_training_max"], "value": gap,
                            "pass": gap <= TARGETS["gap_to_training_max"]},
        "held_out_pairs_within_bound": {"min": TARGETS["held_out_pairs_within_bound_min"],
                                        "value": pairs["held_out_pairs"]["within_bound"],
                                        "pass": (pairs["held_out_pairs"]["within_bound"] or 0.0)
                                        >= TARGETS["held_out_pairs_within_bound_min"]}}
    out = {}
    for row, key in (("held_out", "held_out_phrasing"), ("training", "training_phrasing"),
                     ("caption", "caption_phrasing"), ("canonical", "canonical_caption")):
        out[f"{key}_all_right"] = rows[row]["all_right"]
        out[f"{key}_per_attribute"] = rows[row]["per_attribute"]
    out.update({
        "gap_training_minus_held_out": gap,
        "held_out_pairs_within_30db": share([v >= 30.0 for v in psnrs["held_out_pairs"]]),
        "held_out_vs_canonical_within_30db": share([v >= 30.0 for v in psnrs["held_out_vs_canonical"]]),
        "targets": targets, "rows": rows, "pairs": pairs,
        "held_out_by_family": by_family([r for r in recs if r["row"] == "held_out"]),
        "training_by_family": by_family([r for r in recs if r["row"] == "training"]),
    })
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Tiny-world phrasing benchmark")
    ap.add_argument("--model", default=None, help="ComfyUI diffusion model (default: the committed tiny-world model)")
    ap.add_argument("--scenes", type=int, default=120, help="scenes, alternately one and two objects")
    ap.add_argument("--held-out", type=int, default=3, help="distinct held-out phrasings per scene")
    ap.add_argument("--training", type=int, default=3,
                    help="distinct training-family phrasings per scene: as many as held-out ones, so the "
                         "gap between the two rows compares estimates of one precision (1 before)")
    ap.add_argument("--seed", type=int, default=13, help="scenes and their sampling seeds")
    ap.add_argument("--phrase-seed", type=int, default=2013, help="the phrasings drawn for each scene")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--no-records", action="store_true", help="leave every prompt's record out of the JSON")
    ap.add_argument("--out", default=None, help="default: bench/results/phrasing.json")
    a = ap.parse_args(argv)
    if a.held_out < 2:
        ap.error("--held-out must be at least 2 (pairs of held-out phrasings are measured)")
    bench = _load_bench()
    model = a.model or bench.DEFAULT_MODEL
    out_path = a.out or os.path.join(bench.RESULTS, "phrasing.json")
    t_start = time.time()
    world = bench.World(model, steps=a.steps, cfg=a.cfg, threads=a.threads)
    scenes = scenes_and_seeds(a.scenes, a.seed)
    recs, psnrs = measure(world, bench, scenes, a.held_out, a.phrase_seed, training=a.training)
    from tinyworld import language as LANG
    results = results_of(recs, psnrs, a.psnr_bound)
    results["counts"] = {"scenes": len(scenes), "one_object": sum(len(s["objects"]) == 1 for s, _ in scenes),
                         "two_object": sum(len(s["objects"]) == 2 for s, _ in scenes),
                         "held_out_per_scene": a.held_out, "training_per_scene": a.training,
                         "prompts": {row: results["rows"][row]["n"] for row in ROWS},
                         "videos": len({(r["scene"], r["prompt"]) for r in recs}),
                         "held_out_pairs": len(psnrs["held_out_pairs"])}
    results["settings"] = {
        "model": os.path.relpath(model, REPO) if os.path.abspath(model).startswith(REPO) else model,
        "fingerprint": world.fingerprint, "steps": a.steps, "cfg": a.cfg, "sampler": world.sampler,
        "scheduler": world.scheduler, "seed_policy": "same_seed", "psnr_bound": a.psnr_bound,
        "seed": a.seed, "phrase_seed": a.phrase_seed, "threads": a.threads,
        "train_families": list(measured_training_families()), "held_out_families": list(LANG.HELD_OUT_FAMILIES),
        "per_attribute": "share of prompts with that attribute right for every object (count: object count right)",
        "seconds": round(time.time() - t_start, 1)}
    results["command"] = "python bench/studies/phrasing.py" + "".join(f" {x}" for x in (argv if argv is not None else sys.argv[1:]))
    if not a.no_records:
        results["records"] = recs
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"wrote {out_path}")
    return results


def table(res: dict) -> str:
    lines = [f"{'row':10} {'n':>5} {'all right':>10}  " + " ".join(f"{a:>8}" for a in ATTRS)]
    for row in ROWS:
        r = res["rows"][row]
        lines.append(f"{row:10} {r['n']:5d} {r['all_right']:10.3f}  "
                     + " ".join(f"{r['per_attribute'][a]:8.3f}" for a in ATTRS))
    for k, v in res["pairs"].items():
        lines.append(f"{k:24} n={v['n']:4d} within {v['bound_db']:g} dB: "
                     f"{v['within_bound']:.3f}  median PSNR {v['psnr_median']:.1f}")
    lines += [f"target {k}: {v['value']:.3f} ({'pass' if v['pass'] else 'FAIL'})" for k, v in res["targets"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
