"""Write the tiny-world benchmark workloads (bench/workloads/*.jsonl), deterministically.

    python scripts/make_workloads.py            # iterate, serve, calibration

Each line is a JSON object with at least ``prompt`` and ``seed``; extra fields say what the
line is (``seed_policy``, ``edit``/``kind``, ``session``/``group``) so results can be broken
down, but the benchmark only needs prompt, seed and seed_policy.

- iterate.jsonl: interactive sessions. Each session keeps one seed and edits its prompt step
  by step: left/right flips (position or horizontal motion: textually close, incompatible),
  synonym paraphrases (textually far, compatible), one-of-two-object changes (partial),
  exact repeats. seed_policy same_seed.
- serve.jsonl: a pool of scenes with Zipf popularity; every request is a fresh paraphrase of
  a drawn scene with a random seed, served under the shared_noise policy (4 canonical noises).
- calibration.jsonl: pairs (anchor, variant) of every pair kind of tinyworld.world.make_pair,
  same seed within a pair; seeds and prompt strings disjoint from iterate and serve.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tinyworld import world as WD  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "workloads")


def _copy(scene):
    return {"objects": [dict(o) for o in scene["objects"]]}


def _flip(scene, rng):
    """Flip one left/right word of one object (position slot or horizontal motion)."""
    s = _copy(scene)
    i = rng.randrange(len(s["objects"]))
    o = s["objects"][i]
    used = {x["position"] for j, x in enumerate(s["objects"]) if j != i}
    options = []
    if o["motion"] in ("left", "right"):
        options.append("motion")
    if WD.OPPOSITE[o["position"]] not in used:
        options.append("position")
    attr = rng.choice(options) if options else "motion"
    o[attr] = WD.OPPOSITE[o[attr]]
    return s, attr


def _change_one(scene, rng):
    """Change one attribute (colour, shape or motion) of one of two objects."""
    s = _copy(scene)
    i = rng.randrange(len(s["objects"]))
    o = s["objects"][i]
    attr = rng.choice(("colour", "shape", "motion"))
    if attr == "colour":
        taken = {x["colour"] for x in s["objects"]}
        o["colour"] = rng.choice([c for c in WD.COLOURS if c not in taken])
    elif attr == "shape":
        o["shape"] = rng.choice([x for x in WD.SHAPES if x != o["shape"]])
    else:
        o["motion"] = rng.choice([x for x in WD.MOTIONS if x != o["motion"]])
    return s, attr


def iterate(n_sessions=26, edits=8, seed=1001):
    rng = random.Random(seed)
    lines = []
    for sess in range(n_sessions):
        n_obj = 1 if sess % 2 == 0 else 2
        scene = WD.random_scene(rng, n_obj)
        req_seed = 100_000 + sess
        prompt = WD.caption(scene, canonical=True)
        lines.append({"prompt": prompt, "seed": req_seed, "seed_policy": "same_seed",
                      "session": sess, "edit": "start"})
        for _ in range(edits):
            kinds = ["flip", "synonym", "repeat"] + (["object_change"] * 2 if n_obj == 2 else [])
            kind = rng.choice(kinds)
            if kind == "flip":
                scene, what = _flip(scene, rng)
                prompt = WD.caption(scene, canonical=True)
                edit = f"flip_{what}"
            elif kind == "synonym":
                for k in range(20):
                    p = WD.caption(scene, rng)
                    if p != prompt:
                        break
                prompt, edit = p, "synonym"
            elif kind == "object_change":
                scene, what = _change_one(scene, rng)
                prompt = WD.caption(scene, canonical=True)
                edit = f"object_change_{what}"
            else:
                edit = "repeat"
            lines.append({"prompt": prompt, "seed": req_seed, "seed_policy": "same_seed",
                          "session": sess, "edit": edit})
    return lines


def serve(n_requests=240, n_scenes=40, zipf_s=1.1, seed=2002):
    rng = random.Random(seed)
    scenes = [WD.random_scene(rng) for _ in range(n_scenes)]
    weights = [1.0 / (r + 1) ** zipf_s for r in range(n_scenes)]
    lines = []
    for i in range(n_requests):
        sid = rng.choices(range(n_scenes), weights)[0]
        prompt = WD.caption(scenes[sid], rng)
        lines.append({"prompt": prompt, "seed": 200_000 + rng.randrange(100_000),
                      "seed_policy": "shared_noise", "scene_id": sid})
    return lines


def calibration(n_pairs=110, seed=3003, exclude=()):
    exclude = set(exclude)
    rng = random.Random(seed)
    lines, group, tries = [], 0, 0
    while group < n_pairs:
        tries += 1
        kind = WD.PAIR_KINDS[group % len(WD.PAIR_KINDS)]
        pair = WD.make_pair(kind, 900_000 + tries)
        pa, pb = pair["a"][1], pair["b"][1]
        if pa in exclude or pb in exclude:
            continue
        req_seed = 500_000 + rng.randrange(100_000)
        for role, p in (("anchor", pa), ("variant", pb)):
            lines.append({"prompt": p, "seed": req_seed, "seed_policy": "same_seed",
                          "group": group, "kind": kind, "role": role})
        group += 1
    return lines


def write(name, lines, out):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.jsonl")
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"{path}: {len(lines)} requests")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    it, sv = iterate(), serve()
    cal = calibration(exclude={x["prompt"] for x in it + sv})
    assert not ({x["seed"] for x in cal} & {x["seed"] for x in it + sv})
    write("iterate", it, a.out)
    write("serve", sv, a.out)
    write("calibration", cal, a.out)


if __name__ == "__main__":
    main()
