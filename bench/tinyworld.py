"""Tiny-world benchmark: full computation vs a text-similarity baseline vs Carnator.

    nice -n 10 .venv/bin/python bench/tinyworld.py iterate serve            # full run
    .venv/bin/python bench/tinyworld.py iterate --limit 30                  # a quick look

Every system runs in this one process on the same ComfyUI model (the committed tiny Wan 2.1
model by default), so time ratios are comparable (DESIGN.md §4):

- ``full``: every request computed in full — the reference for fidelity. Under the
  ``shared_noise`` seed policy the reference uses the request's pool noise, as Carnator does.
- ``text``: a NIRVANA/Chorus-style cross-request cache. The most similar earlier request
  with the same noise frame (sentence-embedding cosine, tinyworld.text.sentence_embedding)
  is reused at a skip depth chosen by its similarity band, without verification; an identical
  prompt returns the stored result (exact repeat, as Carnator does). Bands for a threshold τ:
  cos ≥ τ+2δ → deepest stored depth, ≥ τ+δ → middle, ≥ τ → shallow, δ = (1−τ)/3. Each
  request's reuse at each band depth is computed once, so the whole τ sweep is exact and
  cheap. The store holds the earlier requests' *reference* trajectories (which favours the
  baseline slightly: it never reuses a reuse).
- ``carnator``: ``carnator_core.comfy_adapter.run_request`` — probe, lookup, risk-aware gate,
  reuse — with its own cache per risk budget (the sweep), the calibrated risk model for this
  model fingerprint when one exists (bench/calibrate.py), else the uncalibrated prior.
  Sparse attention is off in this sweep, so the study here is the gate.
- ``carnator_sparse``: Carnator at the main budget with block-sparse attention on (DESIGN.md
  §4 compares Carnator with and without it). On a 256-token CPU model the kernel cannot pay
  off in time; what this row shows is fidelity with sparse attention engaged, and how often
  it engaged (``sparse_hit_share``, ``sparse_density_mean``). ``--no-sparse-system`` skips it.

Metrics (DESIGN.md §4), per system: hit_rate (accepted reuses incl. exact repeats / all),
false_accept_rate (accepted reuses whose result misses tolerance: PSNR vs the reference
below --psnr-bound, or the checker disagreeing with the line's scene where the reference agrees),
hit_speedup and workload_speedup (wall-time ratios to the reference), miss_overhead (extra
time on misses), psnr_hits_mean / ssim_hits_mean (gate hits, exact repeats excluded),
checker_accuracy / checker_accuracy_full (all attributes right, system vs reference), plus
gate_* variants that leave exact repeats out.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(REPO, "tests"), REPO):  # REPO first: the tinyworld package, not this file
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from carnator_core.calibration.risk_control import clopper_pearson_lower, clopper_pearson_upper  # noqa: E402

DEFAULT_MODEL = os.path.join(REPO, "models", "tinyworld", "carnator_tinyworld_wan21.safetensors")
WORKLOADS = os.path.join(REPO, "bench", "workloads")
RESULTS = os.path.join(REPO, "bench", "results")
BUDGETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5)
THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.96, 0.98, 0.99)
NOISE_POOL = 4  # ComfyRun's shared_noise pool


# ------------------------------------------------------------------ shared helpers
def load_workload(name_or_path: str, limit: int | None = None) -> tuple[str, list[dict]]:
    """A workload's lines; each must carry its ``scene``, the ground truth it is judged by."""
    path = name_or_path if os.path.isfile(name_or_path) else os.path.join(WORKLOADS, f"{name_or_path}.jsonl")
    name = os.path.splitext(os.path.basename(path))[0]
    lines = []
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                lines.append(json.loads(text))
                require_scene(lines[-1], path, number)
    return name, lines[:limit] if limit else lines


def require_scene(line: dict, path: str, number: int) -> None:
    """Refuse a line without a valid scene: reading one back from the prompt could judge the
    request against a scene it never asked for."""
    from tinyworld import world as WD
    values = {"shape": WD.SHAPES, "colour": WD.COLOURS, "position": WD.POSITIONS, "motion": WD.MOTIONS}
    scene = line.get("scene")
    objects = scene.get("objects") if isinstance(scene, dict) else None
    if objects and all(isinstance(o, dict) and all(o.get(a) in values[a] for a in WD.ATTRIBUTES)
                       for o in objects):
        return
    what = "has no \"scene\"" if scene is None else f"has a scene that is not a tiny-world scene ({scene!r})"
    raise ValueError(
        f"{path} line {number} {what}: the benchmark judges each request by the scene its line "
        'carries ({"objects": [{shape, colour, position, motion}, …]}), never by reading the prompt. '
        "Regenerate the committed workloads with `python scripts/make_workloads.py`; give each line "
        "of a workload of your own its scene.")


def psnr(a: torch.Tensor, b: torch.Tensor, cap: float = 100.0) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return cap if mse <= 10 ** (-cap / 10) else min(cap, 10 * math.log10(1.0 / mse))


def ssim(a: torch.Tensor, b: torch.Tensor, win: int = 7) -> float:
    """Mean SSIM over frames and channels of (3, T, H, W) videos in [0, 1], uniform window."""
    x = a.float().reshape(-1, 1, *a.shape[-2:])
    y = b.float().reshape(-1, 1, *b.shape[-2:])
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mu_x, mu_y = F.avg_pool2d(x, win, 1), F.avg_pool2d(y, win, 1)
    sxx = F.avg_pool2d(x * x, win, 1) - mu_x ** 2
    syy = F.avg_pool2d(y * y, win, 1) - mu_y ** 2
    sxy = F.avg_pool2d(x * y, win, 1) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return float(s.mean())


def noise_frame(seed: int, policy: str) -> str:
    return f"pool:{seed % NOISE_POOL}" if policy == "shared_noise" else f"seed:{seed}"


class World:
    """The ComfyUI tiny-world model plus everything a request needs."""

    def __init__(self, model_path: str = DEFAULT_MODEL, steps: int = 20, cfg: float = 4.0,
                 sampler: str = "euler", scheduler: str = "simple", threads: int = 1,
                 size: str | None = None):
        """``size``: 'FRAMESxPIXELS' (e.g. '8x48', a size the multi-size model is trained on);
        None: the bundled model's 4 frames of 32 px."""
        from comfy_host import import_comfy
        import_comfy()
        torch.set_num_threads(threads)
        import comfy.sd
        from tinyworld import world as WD
        self.model_path = model_path
        self.model = comfy.sd.load_diffusion_model(model_path)
        self.steps, self.cfg, self.sampler, self.scheduler = steps, cfg, sampler, scheduler
        frames, pixels = WD.parse_sizes(size)[0] if size else (WD.T, WD.H)
        self.size = f"{frames}x{pixels}"
        self.latent_shape = (1, 16, frames, pixels // 2, pixels // 2)
        self._cond: dict[str, list] = {}
        self.negative = self.cond("")
        self.meter = compute_meter(self.model)

    def cond(self, prompt: str):
        if prompt not in self._cond:
            from tinyworld import text as TXT
            _, _, frames, h, w = self.latent_shape
            self._cond[prompt] = TXT.conditioning(prompt, frames, h, w)
        return self._cond[prompt]

    def latent(self) -> dict:
        return {"samples": torch.zeros(self.latent_shape)}

    def with_model(self, model) -> "World":
        """The same world on another ComfyUI model (e.g. the model with EasyCache applied)."""
        other = copy.copy(self)
        other.model = model
        return other

    @property
    def fingerprint(self) -> str:
        from carnator_core.comfy_adapter import model_fingerprint
        return model_fingerprint(self.model)

    def new_run(self, prompt: str, seed: int, policy: str):
        from carnator_core.comfy_adapter import ComfyRun
        return ComfyRun(self.model, self.cond(prompt), self.negative, self.latent(), seed,
                        self.steps, self.cfg, self.sampler, self.scheduler, seed_policy=policy)

    @staticmethod
    def video(samples: torch.Tensor) -> torch.Tensor:
        from tinyworld import latent as LAT
        return LAT.decode_comfy(samples.float(), clamp=True)[0]

    def full(self, prompt: str, seed: int, policy: str, snapshot_steps=(), probe_steps: int = 2) -> dict:
        """The request computed in full, with its trajectory recorded (snapshots, tiles)."""
        from carnator_core.calibration.generic import compute_full
        t0 = time.perf_counter()
        run = self.new_run(prompt, seed, policy)
        got = compute_full(run, list(snapshot_steps), probe_steps)
        seconds = time.perf_counter() - t0
        return {"run": run, "record": got.record, "final": got.final, "seconds": seconds,
                "x0_probe": got.x0_probe, "x_probe": got.x_probe, "full": got,
                "video": self.video(got.final)}

    def resume(self, run, x_k_sampler_space: torch.Tensor, k: int) -> torch.Tensor:
        """Finish ``run`` from a sampler-space latent at step k (the reuse path)."""
        return run.sample(k, run.steps, run.boundary_from_sampler_space(x_k_sampler_space, k))


def compute_meter(model):
    """The work the diffusion model really does: token rows entering its last transformer
    block (``comfy_adapter.attach_meter``, the hook every calibration meters with), counted
    into a ``carnator_core.calibration.meter.ComputeMeter`` for the whole process."""
    from carnator_core.calibration.meter import ComputeMeter as Meter
    from carnator_core.comfy_adapter import attach_meter
    meter = Meter()
    attach_meter(model, meter)
    return meter


ATTRS = ("shape", "colour", "position", "motion", "count")


def check_ok(video: torch.Tensor, scene: dict, attrs: dict | None = None) -> bool:
    """Checker verdict against a workload line's scene (all attributes right); per-attribute
    agreement into ``attrs``."""
    from tinyworld import checker as CH
    if not isinstance(scene, dict):
        raise TypeError(f"check_ok takes a workload line's scene, not {type(scene).__name__}: "
                        "the benchmark never parses prompts")
    res = CH.check(video, scene)
    if attrs is not None:
        attrs.update({a: float(res[a]) for a in ATTRS})
    return bool(res["all"] >= 1.0)


# ------------------------------------------------------------------ metrics
def workload_psnr(recs: list[dict]) -> float | None:
    if not recs:
        return None
    mse = sum(10 ** (-r["psnr"] / 10) for r in recs) / len(recs)
    return 100.0 if mse <= 1e-10 else 10 * math.log10(1.0 / mse)


def same_scene(scene_a: dict, scene_b: dict) -> bool:
    """Do two workload lines' scenes agree (paraphrases, repeats), whatever their prose?"""
    from tinyworld import world as WD
    return WD.scene_key(scene_a) == WD.scene_key(scene_b)


def measured_ratio(recs: list[dict]) -> float | None:
    """Steps of a full computation over the steps the model measurably computed."""
    if not recs or any(r.get("steps_measured") is None for r in recs):
        return None
    done = sum(r["steps_measured"] for r in recs)
    return sum(r["steps_total"] for r in recs) / done if done > 0 else None


def session_interval(recs: list[dict], failed, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95% percentile interval of the failure rate over ``recs`` when whole sessions are
    resampled (records of one session share a seed and its sources, so their outcomes are not
    independent, as Clopper–Pearson assumes). None without session ids."""
    sessions: dict = {}
    for r in recs:
        if r.get("session") is None:
            return None
        s = sessions.setdefault(r["session"], [0, 0])
        s[0], s[1] = s[0] + 1, s[1] + int(failed(r))
    if len(sessions) < 2:
        return None
    rng, groups, rates = random.Random(seed), list(sessions.values()), []
    for _ in range(resamples):
        pick = [rng.choice(groups) for _ in groups]
        rates.append(sum(f for _, f in pick) / sum(n for n, _ in pick))
    rates.sort()
    return [rates[int(0.025 * resamples)], rates[int(0.975 * resamples) - 1]]


def metrics(recs: list[dict], psnr_bound: float) -> dict:
    n = len(recs)

    def fa(r, psnr_key="psnr", ok_key="ok_full"):  # beyond tolerance of that reference
        return r[psnr_key] < psnr_bound or (r[ok_key] and not r["ok"])

    acc = [r for r in recs if r["outcome"] in ("hit", "exact")]
    gate = [r for r in recs if r["outcome"] == "hit"]
    miss = [r for r in recs if r["outcome"] == "miss"]

    def ratio(rs, num, den):
        d = sum(r[den] for r in rs)
        return sum(r[num] for r in rs) / d if rs and d > 0 else None

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else None

    mo = ratio(miss, "t", "t_full")
    n_fa = sum(fa(r) for r in acc)
    own = [r for r in acc if "psnr_own" in r]  # judged against the model's own full computation
    n_fa_own = sum(fa(r, "psnr_own", "ok_own_ref") for r in own)
    same = [r for r in gate if r.get("same_scene")]
    other = [r for r in gate if r.get("same_scene") is False]
    return {
        "false_accept_ci95": [clopper_pearson_lower(n_fa, len(acc), 0.025),
                              clopper_pearson_upper(n_fa, len(acc), 0.025)] if acc else None,
        # the same with whole sessions resampled (editing workloads; None elsewhere)
        "false_accept_ci95_sessions": session_interval(acc, fa) if acc else None,
        "same_scene_hit_rate": len(same) / n if n else 0.0,
        "steps_speedup_same_scene_hits": ratio(same, "steps_total", "steps_computed"),
        "steps_speedup_other_hits": ratio(other, "steps_total", "steps_computed"),
        "gate_hit_speedup_same_scene": ratio(same, "t_full", "t"),
        "mean_reuse_step": mean(r["reuse_step"] for r in gate if r.get("reuse_step") is not None),
        # 10·log10(1 / mean MSE): one quality number for a whole workload, exact results included
        "psnr_workload": workload_psnr(recs),
        "requests": n,
        "hit_rate": len(acc) / n if n else 0.0,
        "exact_rate": (len(acc) - len(gate)) / n if n else 0.0,
        "gate_hit_rate": len(gate) / n if n else 0.0,
        "false_accept_rate": (sum(fa(r) for r in acc) / len(acc)) if acc else 0.0,
        "gate_false_accept_rate": (sum(fa(r) for r in gate) / len(gate)) if gate else 0.0,
        "false_accepts": sum(fa(r) for r in acc),
        # on a model with EasyCache: against that model's own full computation (the reference
        # its calibration certifies), beside the plain model's above
        "false_accept_rate_own_model": (n_fa_own / len(own)) if own else None,
        "false_accepts_own_model": n_fa_own if own else None,
        "judged_own_model": len(own),
        "false_accept_ci95_own_model": [clopper_pearson_lower(n_fa_own, len(own), 0.025),
                                        clopper_pearson_upper(n_fa_own, len(own), 0.025)] if own else None,
        "hit_speedup": ratio(acc, "t_full", "t"),
        "gate_hit_speedup": ratio(gate, "t_full", "t"),
        "steps_speedup_hits": ratio(gate, "steps_total", "steps_computed"),
        # the same ratios from the model's own work (compute_meter): every system alike,
        # EasyCache's skipped calls included; None where a record has no measurement
        "compute_speedup_workload": measured_ratio(recs),
        "compute_speedup_hits": measured_ratio(gate),
        "workload_speedup": ratio(recs, "t_full", "t"),
        "miss_overhead": (mo - 1.0) if mo is not None else None,
        "miss_overhead_seconds": mean(r["t"] - r["t_full"] for r in miss),
        "psnr_hits_mean": mean(r["psnr"] for r in gate),
        "ssim_hits_mean": mean(r["ssim"] for r in gate),
        "psnr_all_mean": mean(r["psnr"] for r in recs),
        "checker_accuracy": mean(float(r["ok"]) for r in recs),
        "checker_accuracy_full": mean(float(r["ok_full"]) for r in recs),
        "checker_accuracy_hits": mean(float(r["ok"]) for r in acc),
        "checker_accuracy_full_on_hits": mean(float(r["ok_full"]) for r in acc),
        "checker_attributes": {a: mean(r["attrs"][a] for r in recs if "attrs" in r) for a in ATTRS}
        if any("attrs" in r for r in recs) else None,
        "checker_attributes_full": {a: mean(r["attrs_full"][a] for r in recs if "attrs_full" in r) for a in ATTRS}
        if any("attrs_full" in r for r in recs) else None,
    }


# ------------------------------------------------------------------ systems
def run_reference(world: World, lines: list[dict], snapshot_steps, probe_steps) -> list[dict]:
    refs = []
    for i, ln in enumerate(lines):
        policy = ln.get("seed_policy", "same_seed")
        rows = world.meter.rows
        r = world.full(ln["prompt"], int(ln["seed"]), policy, snapshot_steps, probe_steps)
        r["rows"] = world.meter.rows - rows
        r["attrs"] = {}
        r["ok"] = check_ok(r["video"], ln["scene"], r["attrs"])
        r["frame"] = noise_frame(int(ln["seed"]), policy)
        r["policy"] = policy
        refs.append(r)
    return refs


def rows_per_step(refs: list[dict], steps: int) -> float:
    """The meter's unit: token rows one step of a full computation brings (from the references)."""
    return sum(r.get("rows", 0) for r in refs) / (len(refs) * steps) if refs else 0.0


def run_text(world: World, lines, refs, band_depths, thresholds, psnr_bound) -> tuple[list, dict]:
    """Measure every request's reuse at every band depth once; evaluate the τ sweep."""
    from tinyworld import text as TXT
    steps = world.steps
    per = []  # per request: best match and its results at each depth
    embs: list[torch.Tensor] = []
    for i, ln in enumerate(lines):
        t0 = time.perf_counter()
        e = TXT.sentence_embedding([ln["prompt"]])[0]
        same = [j for j in range(i) if refs[j]["frame"] == refs[i]["frame"]]
        best, sim = None, -1.0
        for j in same:
            s = float(torch.dot(e, embs[j]))
            if s > sim:
                best, sim = j, s
        t_lookup = time.perf_counter() - t0
        embs.append(e)
        item = {"match": best, "sim": sim, "t_lookup": t_lookup, "depths": {}, "exact": False}
        if best is not None and lines[best]["prompt"] == ln["prompt"]:
            item["exact"] = True
        elif best is not None:
            for k in band_depths:
                t0 = time.perf_counter()
                run = world.new_run(ln["prompt"], int(ln["seed"]), refs[i]["policy"])
                out = world.resume(run, refs[best]["record"].snapshots[k].to(torch.float32), k)
                t = time.perf_counter() - t0 + t_lookup
                v = world.video(out)
                attrs = {}
                item["depths"][k] = {"t": t, "psnr": psnr(v, refs[i]["video"]),
                                     "ssim": ssim(v, refs[i]["video"]),
                                     "ok": check_ok(v, ln["scene"], attrs), "attrs": attrs,
                                     "steps_computed": steps - k}
        per.append(item)

    def records_for(tau):
        delta = (1.0 - tau) / 3.0
        recs = []
        for i, item in enumerate(per):
            base = {"t_full": refs[i]["seconds"], "ok_full": refs[i]["ok"], "steps_total": steps,
                    "attrs": refs[i]["attrs"], "attrs_full": refs[i]["attrs"]}
            if item["exact"]:
                recs.append({**base, "outcome": "exact", "t": item["t_lookup"] + 1e-4, "psnr": 100.0,
                             "ssim": 1.0, "ok": refs[i]["ok"], "steps_computed": 0})
                continue
            k = None
            if item["match"] is not None:
                if item["sim"] >= tau + 2 * delta:
                    k = band_depths[-1]
                elif item["sim"] >= tau + delta:
                    k = band_depths[len(band_depths) // 2]
                elif item["sim"] >= tau:
                    k = band_depths[0]
            if k is None:
                recs.append({**base, "outcome": "miss", "t": refs[i]["seconds"] + item["t_lookup"],
                             "psnr": 100.0, "ssim": 1.0, "ok": refs[i]["ok"], "steps_computed": steps})
            else:
                d = item["depths"][k]
                recs.append({**base, "outcome": "hit", **d})
        return recs

    sweep = {}
    for tau in thresholds:
        recs = records_for(tau)
        sweep[tau] = (metrics(recs, psnr_bound), recs)
    return per, sweep


def eased(world: World, threshold: float) -> World:
    """The world's model with ComfyUI's own EasyCache applied (its node, default range)."""
    from comfy_extras.nodes_easycache import EasyCacheNode
    return world.with_model(EasyCacheNode.execute(world.model, threshold, 0.15, 0.95, False).result[0])


def run_easycache(world: World, lines, refs, threshold: float, psnr_bound: float,
                  keep: dict | None = None) -> dict:
    """Every request computed with EasyCache alone (no cross-request reuse); its results into
    ``keep[threshold]``, the full computations of the model with EasyCache (what Carnator on
    that model is certified against)."""
    ew = eased(world, threshold)
    recs, unit = [], rows_per_step(refs, world.steps)
    own = run_reference(ew, lines, (), 1)
    if keep is not None:
        keep[threshold] = [{"video": r["video"], "ok": r["ok"]} for r in own]
    for ref, r in zip(refs, own):
        recs.append({"outcome": "miss", "t": r["seconds"], "t_full": ref["seconds"],
                     "steps_measured": world.meter.steps(r["rows"], unit),
                     "psnr": psnr(r["video"], ref["video"]), "ssim": ssim(r["video"], ref["video"]),
                     "ok": r["ok"], "ok_full": ref["ok"], "steps_total": world.steps,
                     "steps_computed": world.steps, "attrs": r["attrs"], "attrs_full": ref["attrs"]})
    return metrics(recs, psnr_bound)


class PlanTap:
    """The gate's plan for one request, as the pipeline hands it to the reuse: its evidence
    ``features`` go into the request's record (the Summary does not carry them). Wraps
    ``carnator_core.pipeline.reuse`` for the one request and puts it back after. Bench only."""

    def __enter__(self) -> "PlanTap":
        from carnator_core import pipeline
        self._pipeline, self._reuse, self._decide = pipeline, pipeline.reuse, pipeline.decide
        self.plan, self.verdicts = None, None

        def reuse(pr, plan):
            self.plan = plan
            return self._reuse(pr, plan)

        def decide(*args, **kwargs):  # the gate's own decision comes first (a source check may follow)
            plan, verdicts = self._decide(*args, **kwargs)
            if self.verdicts is None:
                self.verdicts = verdicts
            return plan, verdicts
        pipeline.reuse, pipeline.decide = reuse, decide
        return self

    def __exit__(self, *exc) -> None:
        self._pipeline.reuse, self._pipeline.decide = self._reuse, self._decide

    def candidates(self) -> list[dict]:
        """Every candidate the gate weighed: entry, evidence class, its verdict (accepted, k*,
        predicted risk, why not) and evidence; [] where the gate weighed none."""
        from carnator_core.gate import evidence_class
        return [{"entry_id": v.entry_id, "class": evidence_class(v.features) if v.features else None,
                 "accept": v.accept, "reuse_step": v.reuse_step, "risk": v.risk, "why": v.why,
                 "features": {k: float(x) for k, x in (v.features or {}).items()}}
                for v in self.verdicts or []]

    def features(self) -> dict | None:
        """The plan's features (the accepted candidate's on a hit, the deciding verdict's on a
        miss), floats; None where the gate decided nothing (an exact repeat, no candidate)."""
        feats = getattr(self.plan, "features", None)
        return {k: float(v) for k, v in feats.items()} if feats else None


def run_carnator(world: World, lines, refs, budget, risk_model_path, psnr_bound, sparse: bool,
                 workdir: str, fill_calls: int = 0, min_saving: float = 0.0,
                 recurring: bool | None = None,
                 probe_fraction: float | None = None,
                 own_refs: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """``own_refs``: the full computations of ``world``'s own model when it is not the
    reference model (EasyCache applied): each hit is judged against them too."""
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import DEFAULT_PROBE_FRACTION, GateSettings, calibration_file
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.reuse.sparse_reuse import SparseSettings
    folder = os.path.join(workdir, f"carnator_{budget:g}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    probe_fraction = DEFAULT_PROBE_FRACTION if probe_fraction is None else probe_fraction
    if risk_model_path:  # where the gate looks for this probe's calibration
        dst = calibration_file(folder, world.fingerprint, probe_fraction)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(risk_model_path, dst)
    settings = ReuseSettings(probe_fraction=probe_fraction,
                             gate=GateSettings(risk_budget=budget, min_saving=min_saving,
                                                recurring_sources=(GateSettings.recurring_sources
                                                                   if recurring is None else recurring)),
                             sparse=SparseSettings(enabled=sparse), region_fill_calls=fill_calls)
    recs, scene_of, unit = [], {}, rows_per_step(refs, world.steps)
    for i, ln in enumerate(lines):
        t0, rows = time.perf_counter(), world.meter.rows
        with PlanTap() as tap:
            samples, s = run_request(world.model, world.cond(ln["prompt"]), world.negative, world.latent(),
                                     int(ln["seed"]), world.steps, world.cfg, world.sampler, world.scheduler,
                                     settings, {"folder": folder, "capacity_bytes": 1 << 30},
                                     seed_policy=refs[i]["policy"], label=ln["prompt"])
        t = time.perf_counter() - t0
        measured = world.meter.steps(world.meter.rows - rows, unit)
        v = world.video(samples)
        attrs = {}
        recs.append({"outcome": s.outcome, "t": t, "t_full": refs[i]["seconds"],
                     "psnr": psnr(v, refs[i]["video"]), "ssim": ssim(v, refs[i]["video"]),
                     "ok": check_ok(v, ln["scene"], attrs), "ok_full": refs[i]["ok"],
                     "attrs": attrs, "attrs_full": refs[i]["attrs"],
                     "steps_total": s.steps_total, "steps_computed": s.step_equivalents,
                     "steps_measured": measured,
                     "region_calls": s.region_calls, "reuse_step": s.reuse_step, "risk": s.risk,
                     "sparse_calls": s.sparse_calls, "sparse_density": s.sparse_density,
                     "region_fraction": s.region_fraction, "edit": ln.get("edit") or ln.get("kind"),
                     "session": ln.get("session"),
                     "entry_id": s.entry_id, "stored_id": s.stored_id, "features": tap.features(),
                     "why": s.why, "reason": s.reason,  # why no reuse served it (gate.WHY_NOT)
                     "candidates": tap.candidates(),
                     "same_scene": (same_scene(ln["scene"], scene_of[s.entry_id])
                                    if s.outcome == "hit" and s.entry_id in scene_of else None)})
        if own_refs is not None:
            recs[-1]["psnr_own"] = psnr(v, own_refs[i]["video"])
            recs[-1]["ok_own_ref"] = own_refs[i]["ok"]
        if s.stored_id:
            scene_of[s.stored_id] = ln["scene"]
    m = metrics(recs, psnr_bound)
    m["not_reused"] = not_reused(recs)
    if sparse:
        gate_hits = [r for r in recs if r["outcome"] == "hit"]
        engaged = [r for r in gate_hits if r["sparse_calls"]]
        m["sparse_hit_share"] = len(engaged) / len(gate_hits) if gate_hits else None
        m["sparse_calls"] = sum(r["sparse_calls"] for r in recs)
        m["sparse_density_mean"] = (sum(r["sparse_density"] for r in engaged) / len(engaged)
                                    if engaged else None)
    return m, recs


def not_reused(recs: list[dict]) -> dict[str, int]:
    """The requests no gate hit served, counted by why (``gate.WHY_NOT``; exact repeats too)."""
    from collections import Counter
    return dict(Counter(r.get("why") or "?" for r in recs if r["outcome"] != "hit").most_common())


def pick_text_point(text_sweep: dict, target_hit_rate: float) -> float:
    """The τ whose hit rate is closest to the target (ties: lower false-accept rate)."""
    return min(text_sweep, key=lambda t: (abs(text_sweep[t][0]["hit_rate"] - target_hit_rate),
                                          text_sweep[t][0]["false_accept_rate"]))


def _matched(budget: float, c: dict, text_sweep: dict) -> dict:
    """One Carnator point against the text sweep: at matched hit rate, and at matched
    (≤) false-accept rate."""
    tau = pick_text_point(text_sweep, c["hit_rate"])
    ok = [m for m, _ in text_sweep.values() if m["false_accept_rate"] <= c["false_accept_rate"]]
    return {"risk_budget": budget, "carnator_hit_rate": c["hit_rate"],
            "carnator_false_accept_rate": c["false_accept_rate"],
            "text_threshold_at_matched_hit_rate": tau,
            "text_hit_rate_at_matched_hit_rate": text_sweep[tau][0]["hit_rate"],
            "text_false_accept_rate_at_matched_hit_rate": text_sweep[tau][0]["false_accept_rate"],
            "text_best_hit_rate_at_matched_false_accept": max((m["hit_rate"] for m in ok), default=None)}


def breakdown(recs: list[dict], psnr_bound: float) -> dict:
    out = {}
    for r in recs:
        out.setdefault(r.get("edit") or "?", []).append(r)
    return {k: {"n": len(v), "hit_rate": metrics(v, psnr_bound)["hit_rate"],
                "false_accepts": metrics(v, psnr_bound)["false_accepts"]} for k, v in sorted(out.items())}


# ------------------------------------------------------------------ plots
def plot(results: dict, out_dir: str) -> list[str]:
    series_far, series_psnr = [], []
    for name, sw in results["sweeps"].items():
        for system in ("text", "carnator"):
            pts = [(p["hit_rate"], p["false_accept_rate"]) for p in sw[system]]
            series_far.append((f"{name} {system}", sorted(pts)))
            pts = [(p["hit_speedup"], p["psnr_hits_mean"]) for p in sw[system]
                   if p["hit_speedup"] is not None and p["psnr_hits_mean"] is not None]
            series_psnr.append((f"{name} {system}", sorted(pts)))
    paths = [os.path.join(out_dir, "tinyworld_false_accept_vs_hit_rate.png"),
             os.path.join(out_dir, "tinyworld_psnr_vs_speedup.png")]
    specs = [(series_far, "hit rate", "false-accept rate", paths[0]),
             (series_psnr, "speedup on hits (x)", "mean PSNR on gate hits (dB)", paths[1])]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        for series, xl, yl, path in specs:
            fig, ax = plt.subplots(figsize=(6, 4.5))
            for label, pts in series:
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if "carnator" in label else "s--", label=label)
            ax.set_xlabel(xl), ax.set_ylabel(yl), ax.legend(fontsize=8), ax.grid(alpha=0.3)
            fig.tight_layout(), fig.savefig(path, dpi=120), plt.close(fig)
    except ImportError:
        for (series, xl, yl, path), where in zip(specs, ("top left", "top right")):
            _pil_plot(series, xl, yl, path, legend=where, by_workload=True)
    return paths


def _pil_plot(series, xlabel, ylabel, path, size=(640, 480), from_zero=True, legend="top right",
              by_workload=False):
    """Minimal line plot with Pillow (used when matplotlib is not installed); ``from_zero``
    False fits both axes to the data (with a margin), ``legend`` "top left" or "bottom left"
    moves the key."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    l, t, r, b = 70, 20, size[0] - 20, size[1] - 60
    xs = [p[0] for _, pts in series for p in pts] or [0, 1]
    ys = [p[1] for _, pts in series for p in pts] or [0, 1]
    if from_zero:
        x0, x1 = min(xs + [0.0]), max(xs + [1e-6])
        y0, y1 = min(ys + [0.0]), max(ys + [1e-6])
    else:
        mx, my = 0.05 * (max(xs) - min(xs)), 0.05 * (max(ys) - min(ys))
        x0, x1, y0, y1 = min(xs) - mx, max(xs) + mx, min(ys) - my, max(ys) + my
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def px(x, y):
        return l + (x - x0) / (x1 - x0) * (r - l), b - (y - y0) / (y1 - y0) * (b - t)

    d.rectangle([l, t, r, b], outline="black")
    for i in range(6):
        fx, fy = x0 + i * (x1 - x0) / 5, y0 + i * (y1 - y0) / 5
        X, _ = px(fx, y0)
        _, Y = px(x0, fy)
        d.text((X - 12, b + 5), f"{fx:.2f}", fill="black")
        d.text((5, Y - 6), f"{fy:.2f}", fill="black")
    d.text(((l + r) // 2 - 40, b + 22), xlabel, fill="black")
    d.text((5, 2), ylabel, fill="black")
    colours = ["#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    # ``by_workload`` ("<workload> <system>" labels): one colour per workload, text similarity's
    # points square and its line thin, Carnator's round; else one colour per series
    groups = list(dict.fromkeys(label.rsplit(" ", 1)[0] if by_workload else label for label, _ in series))
    for i, (label, pts) in enumerate(series):
        c = colours[groups.index(label.rsplit(" ", 1)[0] if by_workload else label) % len(colours)]
        text = by_workload and label.endswith(" text")
        q = [px(*p) for p in pts]
        if len(q) > 1:
            d.line(q, fill=c, width=1 if text else 3)
        for X, Y in q:
            (d.rectangle if text else d.ellipse)([X - 3, Y - 3, X + 3, Y + 3], fill=c)
        at = {"top right": (r - 170, t + 8 + 14 * i), "top left": (l + 8, t + 8 + 14 * i)}.get(
            legend, (l + 8, b - 14 * (len(series) - i) - 4))
        d.text(at, label + (" (squares)" if text else ""), fill=c)
    img.save(path)


# ------------------------------------------------------------------ main
def fmt(v, pct=False):
    if v is None:
        return "—"
    return f"{100 * v:5.1f}%" if pct else f"{v:6.2f}"


def table(results: dict) -> str:
    cols = [("hit_rate", True), ("false_accept_rate", True), ("hit_speedup", False),
            ("workload_speedup", False), ("miss_overhead", True), ("psnr_hits_mean", False),
            ("ssim_hits_mean", False), ("checker_accuracy", True), ("checker_accuracy_full", True)]
    head = f"{'workload':10s} {'system':9s} " + " ".join(f"{c[:12]:>12s}" for c, _ in cols)
    out = [head, "-" * len(head)]
    for name, systems in results["workloads"].items():
        for sysname, m in systems.items():
            out.append(f"{name:10s} {sysname:9s} " + " ".join(f"{fmt(m.get(c), p):>12s}" for c, p in cols))
    return "\n".join(out)


BUNDLED_CALIBRATIONS = os.path.join(REPO, "models")  # models/calibration/: what the nodes install


def default_risk_model(fingerprint: str, probe_fraction: float | None = None,
                       steps: int = 0) -> str | None:
    """The bundled calibration for this model, probe and N (the one the nodes use), if any."""
    from carnator_core.gate import DEFAULT_PROBE_FRACTION, calibration_in_use
    p = calibration_in_use(BUNDLED_CALIBRATIONS, fingerprint, probe_fraction or DEFAULT_PROBE_FRACTION,
                           steps)
    return str(p) if p.is_file() else None


def calibration_record(path: str | None) -> dict | None:
    """Which calibration a result was measured with: its path in the repository and sha256."""
    if not path:
        return None
    import hashlib
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"path": os.path.relpath(path, REPO), "sha256": digest}


def easycache_risk_model(folder: str | None, fingerprint: str, probe_fraction: float | None) -> str | None:
    """The calibration of the EasyCache'd model in ``folder`` (a cache or results folder, or
    the ``calibration/`` folder inside one); None without a folder. A folder given without
    this model's calibration is an error: falling back to the plain model's calibration
    silently is how a study once ran Carnator + EasyCache on the wrong one."""
    if not folder:
        return None
    from carnator_core.gate import DEFAULT_PROBE_FRACTION, calibration_file
    probe = DEFAULT_PROBE_FRACTION if probe_fraction is None else probe_fraction
    norm = os.path.normpath(folder)
    base = os.path.dirname(norm) if os.path.basename(norm) == "calibration" else norm
    path = calibration_file(base or ".", fingerprint, probe)
    if not path.is_file():
        raise SystemExit(f"--easycache-risk-model {folder}: no calibration of the EasyCache'd model "
                         f"(fingerprint {fingerprint}, probe {probe:g}) at {path}; measure one with "
                         "bench/calibrate.py --easycache T, or leave the option out")
    return str(path)


def merge(paths: list[str], out: str, plots: bool = True) -> dict:
    """One results file from several runs of this script on different workloads."""
    results: dict = {}
    for p in paths:
        with open(p) as f:
            part = json.load(f)
        if not results:
            results = {k: v for k, v in part.items() if k != "plots"}
            results["settings"] = {**part["settings"], "merged_from": [], "seconds": 0.0}
            for key in ("workloads", "sweeps", "comparison", "breakdown", "records"):
                results[key] = {}
        if part["settings"]["fingerprint"] != results["settings"]["fingerprint"]:
            raise SystemExit(f"{p} was measured on another model; not merging")
        for key in ("workloads", "sweeps", "comparison", "breakdown", "records"):
            results[key].update(part.get(key, {}))
        results["settings"]["merged_from"].append(os.path.basename(p))
        results["settings"]["seconds"] += part["settings"].get("seconds", 0.0)
    if plots:
        results["plots"] = [os.path.relpath(p, REPO) if p.startswith(REPO) else p
                            for p in plot(results, os.path.dirname(os.path.abspath(out)))]
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"wrote {out}")
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Tiny-world benchmark (DESIGN.md §4)")
    ap.add_argument("workloads", nargs="*", default=["iterate", "serve"],
                    help="workload names under bench/workloads or .jsonl paths")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each workload")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    ap.add_argument("--main-budget", type=float, default=0.05)
    ap.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--risk-model", default="auto",
                    help="fitted risk model json; 'auto': the bundled models/calibration/<fingerprint>….json "
                         "if present; 'prior': the uncalibrated default")
    ap.add_argument("--probe-fraction", type=float, default=None,
                    help="the probe's share of the steps (ReuseSettings.probe_fraction; default: the "
                         "samplers' default); --risk-model auto finds the committed calibration for this probe")
    ap.add_argument("--no-sparse-system", action="store_true",
                    help="skip the carnator_sparse system (Carnator at the main budget, sparse attention on)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--size", default=None, metavar="FRAMESxPIXELS",
                    help="generate at this size (the multi-size model's sizes, tinyworld.world.SIZES); "
                         "default the bundled model's 4x32")
    ap.add_argument("--no-text-baseline", action="store_true",
                    help="leave out the prompt-text cache baseline (its three reuses per request cost "
                         "~1.5 generations each; a study of Carnator alone at a large size)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tinyworld.json"))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--fill-calls", type=int, default=None,
                    help="model steps filling region M on a hit (default: ReuseSettings')")
    ap.add_argument("--min-saving", type=float, default=0.0,
                    help="the gate's min_saving (default 0): hits saving less run in full and become sources")
    ap.add_argument("--recurring-sources", action=argparse.BooleanOptionalAction, default=True,
                    help="the gate's recurring_sources (default on): a scene asked again after a "
                         "reuse runs in full once; --no-recurring-sources for the rule before it")
    ap.add_argument("--easycache", type=float, nargs="*", default=[],
                    help="also run ComfyUI's EasyCache alone at these thresholds")
    ap.add_argument("--easycache-carnator", type=float, nargs="*", default=[],
                    help="also run Carnator (main budget) on the model with EasyCache at these thresholds")
    ap.add_argument("--easycache-budgets", type=float, nargs="+", default=None, metavar="ALPHA",
                    help="run Carnator + EasyCache at these budgets (default: the main budget alone); "
                         "each lands in the workload's sweeps under carnator_easycache_<threshold>")
    ap.add_argument("--easycache-risk-model", default=None, metavar="DIR",
                    help="a folder holding calibrations of the model with EasyCache applied "
                         "(bench/calibrate.py --easycache T; found by that model's fingerprint and "
                         "the probe; the results folder or its calibration/ folder): the Carnator + "
                         "EasyCache runs use them, and stop if the folder lacks one; without this "
                         "option they apply the plain model's calibration")
    ap.add_argument("--records", action="store_true",
                    help="also write every Carnator request's record (per budget) to the JSON")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="merge result files of separate runs (one workload each, e.g. run in "
                         "parallel) into --out, re-plot and print the table; runs nothing")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out, plots=not a.no_plots)

    from carnator_core.gate import DEFAULT_PROBE_FRACTION, GateSettings, RiskModel
    from carnator_core.pipeline import ReuseSettings
    a.probe_fraction = DEFAULT_PROBE_FRACTION if a.probe_fraction is None else a.probe_fraction
    world = World(a.model, steps=a.steps, cfg=a.cfg, threads=a.threads, size=a.size)
    fp = world.fingerprint
    rm_path = default_risk_model(fp, a.probe_fraction, a.steps) if a.risk_model == "auto" else (None if a.risk_model == "prior" else a.risk_model)
    rm = RiskModel.load(rm_path) if rm_path else RiskModel(probe_fraction=a.probe_fraction)
    budgets = sorted(set(a.budgets) | {a.main_budget})
    settings = ReuseSettings(probe_fraction=a.probe_fraction, gate=GateSettings())
    fill_calls = settings.region_fill_calls if a.fill_calls is None else a.fill_calls
    snaps = settings.snapshot_steps(a.steps)
    probe_steps = settings.probe_steps(a.steps)
    band_depths = [snaps[1], snaps[len(snaps) // 2], snaps[-1]] if len(snaps) >= 3 else snaps
    results = {"workloads": {}, "sweeps": {}, "comparison": {}, "breakdown": {},
               "settings": {"model": os.path.relpath(a.model, REPO), "fingerprint": fp, "size": world.size,
                            "steps": a.steps, "cfg": a.cfg, "sampler": world.sampler,
                            "scheduler": world.scheduler, "psnr_bound": a.psnr_bound,
                            "budgets": budgets, "main_budget": a.main_budget,
                            "thresholds": a.thresholds, "text_band_depths": band_depths,
                            "snapshot_steps": snaps, "probe_steps": probe_steps,
                            "probe_fraction": a.probe_fraction,
                            "sparse_system": not a.no_sparse_system, "limit": a.limit,
                            "region_fill_calls": fill_calls, "min_saving": a.min_saving,
                            "recurring_sources": a.recurring_sources,
                            "easycache": a.easycache,
                            "easycache_carnator": a.easycache_carnator,
                            "easycache_budgets": a.easycache_budgets,
                            "easycache_risk_model": a.easycache_risk_model,
                            "risk_model": rm.source, "risk_model_calibrated": rm.calibrated,
                            "calibration": calibration_record(rm_path),
                            "threads": a.threads}}
    workdir = tempfile.mkdtemp(prefix="carnator_bench_")
    t_start = time.time()
    try:
        for wl in a.workloads:
            name, lines = load_workload(wl, a.limit)
            print(f"[{name}] {len(lines)} requests: reference …", flush=True)
            refs = run_reference(world, lines, snaps, probe_steps)
            unit = rows_per_step(refs, a.steps)
            full_recs = [{"outcome": "miss", "t": r["seconds"], "t_full": r["seconds"], "psnr": 100.0,
                          "steps_measured": world.meter.steps(r["rows"], unit),
                          "ssim": 1.0, "ok": r["ok"], "ok_full": r["ok"], "steps_total": a.steps,
                          "steps_computed": a.steps, "attrs": r["attrs"], "attrs_full": r["attrs"]}
                         for r in refs]
            text_sweep = None
            if not a.no_text_baseline:
                print(f"[{name}] text baseline (τ sweep) …", flush=True)
                _, text_sweep = run_text(world, lines, refs, band_depths, a.thresholds, a.psnr_bound)
            carn = {}
            for b in budgets:
                print(f"[{name}] carnator α={b:g} …", flush=True)
                carn[b] = run_carnator(world, lines, refs, b, rm_path, a.psnr_bound, False, workdir,
                                       fill_calls, a.min_saving, a.recurring_sources, a.probe_fraction)
            composed, ec_own = {}, {}
            for tau in sorted(set(a.easycache) | set(a.easycache_carnator)):
                print(f"[{name}] EasyCache {tau:g} …", flush=True)
                composed[f"easycache_{tau:g}"] = {**run_easycache(world, lines, refs, tau, a.psnr_bound,
                                                                  keep=ec_own),
                                                  "easycache_threshold": tau}
            ec_sweeps = {}
            for tau in a.easycache_carnator:
                ew = eased(world, tau)
                ec_rm = easycache_risk_model(a.easycache_risk_model, ew.fingerprint, a.probe_fraction) or rm_path
                key, runs = f"carnator_easycache_{tau:g}", []
                for b in a.easycache_budgets or [a.main_budget]:
                    print(f"[{name}] carnator α={b:g} + EasyCache {tau:g} …", flush=True)
                    m = run_carnator(ew, lines, refs, b, ec_rm, a.psnr_bound,
                                     False, workdir, fill_calls, a.min_saving, a.recurring_sources,
                                     a.probe_fraction, own_refs=ec_own[tau])[0]
                    m = {**m, "easycache_threshold": tau, "risk_budget": b,
                         "risk_model": ec_rm and os.path.relpath(ec_rm, REPO), "calibration": calibration_record(ec_rm)}
                    runs.append(m)
                ec_sweeps[key] = runs  # the workload's row: the main budget's run, else the first
                composed[key] = next((m for m in runs if m["risk_budget"] == a.main_budget), runs[0])
            main_c = carn[a.main_budget][0]
            if a.records:
                results.setdefault("records", {})[name] = {f"{b:g}": recs for b, (_, recs) in carn.items()}
            results["workloads"][name] = {"full": metrics(full_recs, a.psnr_bound),
                                          "carnator": {**main_c, "risk_budget": a.main_budget}}
            if text_sweep is not None:
                tau = pick_text_point(text_sweep, main_c["hit_rate"])
                results["workloads"][name]["text"] = {**text_sweep[tau][0], "threshold": tau}
            results["workloads"][name].update(composed)
            if not a.no_sparse_system:
                print(f"[{name}] carnator α={a.main_budget:g} with sparse attention …", flush=True)
                sp = run_carnator(world, lines, refs, a.main_budget, rm_path, a.psnr_bound, True, workdir,
                                  fill_calls, a.min_saving, a.recurring_sources, a.probe_fraction)[0]
                results["workloads"][name]["carnator_sparse"] = {**sp, "risk_budget": a.main_budget}
            text_points = [{"threshold": t, **m} for t, (m, _) in (text_sweep or {}).items()]
            results["sweeps"][name] = {**({"text": text_points} if text_sweep is not None else {}),
                                       "carnator": [{"risk_budget": b, **m} for b, (m, _) in carn.items()],
                                       **ec_sweeps}
            results["breakdown"][name] = {"carnator": breakdown(carn[a.main_budget][1], a.psnr_bound)}
            if text_sweep is None:
                continue
            tf, cf = text_sweep[tau][0]["false_accept_rate"], main_c["false_accept_rate"]
            results["comparison"][name] = {
                "note": "text point = the τ whose hit rate is closest to Carnator's at the main budget",
                "carnator_hit_rate": main_c["hit_rate"], "text_hit_rate": text_sweep[tau][0]["hit_rate"],
                "carnator_false_accept_rate": cf, "text_false_accept_rate": tf,
                "text_over_carnator_false_accept": (tf / cf) if cf > 0 else (None if tf == 0 else float("inf")),
                "carnator_false_accept_within_budget": {f"{b:g}": carn[b][0]["false_accept_rate"] <= b
                                                        for b in budgets},
                "matched": [_matched(b, carn[b][0], text_sweep) for b in budgets]}
            results["breakdown"][name]["text"] = breakdown([{**r, "edit": ln.get("edit") or ln.get("kind")}
                                                            for r, ln in zip(text_sweep[tau][1], lines)],
                                                           a.psnr_bound)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["settings"]["seconds"] = round(time.time() - t_start, 1)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if not a.no_plots:
        results["plots"] = [os.path.relpath(p, REPO) if p.startswith(REPO) else p
                            for p in plot(results, os.path.dirname(os.path.abspath(a.out)))]
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    print(table(results))
    print(f"risk model: {rm.source}")
    print(f"wrote {a.out}")
    return results


if __name__ == "__main__":
    main()
