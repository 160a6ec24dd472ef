"""Calibrate Carnator's gate on a model from the command line (what the Carnator Calibrate
node does, for long runs outside the UI). Resumable: run the same command again after an
interruption and it continues.

    .venv/bin/python scripts/calibrate_model.py --model /path/wan2.1_t2v_1.3B.safetensors \\
        --clip /path/umt5_xxl.safetensors --clip-type wan --vae /path/wan_2.1_vae.safetensors \\
        --latent 16x5x60x104 --steps 30 --cfg 5 --pairs 200 --prompts my_prompts.txt \\
        --cache /path/ComfyUI/user/carnator_cache

    .venv/bin/python scripts/calibrate_model.py --demo-models      # the bundled tiny models
                                                                   # → models/calibration/

``--latent`` is the latent's C×T×H×W (a Wan 2.1 832×480×17 video is 16×5×60×104); smaller is
faster, but calibrate near the size you generate. Without --clip the pack's demo text
encoder is used (bundled demo models only); without --vae reuses are judged on the latent.

The model's work is counted in generation-equivalents (1 = one full generation at --steps and
--latent; a pair costs about 2 + 7) and printed after every pair with an ETA; the report ends
with the total. ``--budget-generations B`` stops starting new pairs once B is spent (the pair
in progress is finished) and fits what was measured; run it again with a larger B and it
continues, counting what was already spent (kept in the progress file).

``--traffic-prompts FILE``: prompts worded as your users write. As many pairs again are made
from them and every budget is certified on them and on the ``--prompts`` pairs alike, so α
holds on each population, not only on their mix (the report checks each).

``--procedure cheap --budget-generations B`` runs the cheap calibration instead
(carnator_core/calibration/cheap.py): the risk ranking of a calibrated model (``--transfer``,
default the bundled tiny world's) is kept, only its thresholds are certified on this model,
labelling only the reuses the gate would run; it measures with the recipe that ranking was
learned with (probe, fill of M, finishes). On the tiny world ~100 generation-equivalents certify
same-scene reuse at α = 20%, ~200 at 10%, ~400 at 5%; edits need far more (docs/calibration.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from carnator_core.calibration.cheap import BUNDLED_RANKING  # noqa: E402
from carnator_core.gate import DEFAULT_PROBE_FRACTION  # noqa: E402

# The demo models: calibrated at the example workflows' steps and cfg, on a small latent (the
# calibration file is keyed by the model alone; the depth rule works in shares of N).
DEMO = {"wan21": "16x3x16x16", "hunyuan_video": "16x3x16x16", "ltxv": "128x3x8x8",
        "wan22_5b": "48x3x16x16", "hunyuan_video15": "32x3x8x8", "wan22_a14b": "16x3x16x16"}
# two-expert demo models: (high-noise file stem, low-noise file stem), switched half way
DEMO_EXPERTS = {"wan22_a14b": ("wan22_a14b_high", "wan22_a14b_low")}
DEMO_STEPS, DEMO_CFG = 12, 4.0
# The ranking the cheap procedure transfers by default: the bundled tiny world's calibration with
# the deeper recipe (probe 0.05, M filled on its tokens and widened by a tile, region finish).
TRANSFER = ROOT / "models" / "calibration" / BUNDLED_RANKING
# Pairs per model: enough that the "other" evidence class certifies α = 20% (18 accepted
# held-out reuses). HunyuanVideo's random weights put more pairs beyond the region limit.
DEMO_PAIRS = {"wan21": 30, "hunyuan_video": 60, "ltxv": 30, "wan22_5b": 30,
              "hunyuan_video15": 30, "wan22_a14b": 30}


def calibrate_one(model_path: str, latent: str, steps: int, cfg: float, pairs: int,
                  prompts: str, cache: str, clip=None, vae=None, psnr_bound: float = 30.0,
                  sampler: str = "euler", scheduler: str = "simple", seed: int = 0,
                  low_noise_model: str | None = None, switch_step: int = 0,
                  switch_sigma: float = 0.875, probe_fraction: float | None = DEFAULT_PROBE_FRACTION,
                  fill_on_m: bool = False, region_margin: int = 0,
                  budget_generations: float = 0.0, procedure: str = "generic",
                  transfer: str | None = None, served_latent: str | None = None,
                  traffic_prompts: str = "") -> dict:
    import comfy.sd
    import torch
    from carnator_core.calibration import pairs as prompt_pairs
    from carnator_core.comfy_adapter import calibrate_model
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.calibration.generic import report_text
    from carnator_core.calibration.tolerance import Tolerance
    model = comfy.sd.load_diffusion_model(model_path)
    pair = {}
    if low_noise_model:  # Wan 2.2 A14B: the pair is calibrated as one model
        pair = dict(low_noise_model=comfy.sd.load_diffusion_model(low_noise_model),
                    switch_step=switch_step, switch_sigma=switch_sigma)
    def empty(text: str) -> dict:  # "C×T×H×W" → an empty LATENT of batch 1
        return {"samples": torch.zeros((1,) + tuple(int(x) for x in text.lower().split("x")))}
    served = empty(served_latent) if served_latent else None
    transferred, text = None, report_text
    if procedure == "cheap" and traffic_prompts.strip():
        raise SystemExit("--traffic-prompts is for the generic procedure: the cheap one certifies one population")
    if procedure == "cheap":
        from carnator_core.calibration import cheap
        from carnator_core.gate import RiskModel
        transferred = RiskModel.load(transfer or TRANSFER)
        try:
            settings = cheap.settings_for(transferred, probe_fraction)
        except ValueError as e:
            raise SystemExit(f"{e} (or --transfer a calibration for that probe)") from e
        chosen = cheap.pool_from_text(prompts, pairs or cheap.pairs_for_budget(budget_generations or 120), seed=seed)
        text = cheap.report_text
    else:
        settings = ReuseSettings(probe_fraction=probe_fraction or DEFAULT_PROBE_FRACTION, region_fill_on_m=fill_on_m,
                                 region_margin=region_margin if fill_on_m else 0)
        chosen = prompt_pairs.pairs_from_texts(prompts, traffic_prompts, pairs or 60, seed=seed)
    t0 = time.time()
    print(f"  {model_path}: calibrating ({procedure}) {len(chosen)} pairs …", flush=True)
    _, report = calibrate_model(model, clip, empty(latent), chosen, steps, cfg,
                                sampler, scheduler, Tolerance(psnr_bound, "frames" if vae else "latent"),
                                cache, settings, vae=vae, seed=seed, budget_generations=budget_generations,
                                procedure=procedure, transferred=transferred, served_latent=served, **pair)
    print(text(report))
    print(f"  {time.time() - t0:.0f} s, {report.get('cost_generations', 0):.1f} generation-equivalents")
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--clip", nargs="*", default=None, help="text encoder file(s) for comfy.sd.load_clip")
    ap.add_argument("--clip-type", default="wan", help="CLIPType name (wan, hunyuan_video, ltxv, …)")
    ap.add_argument("--vae", default=None)
    ap.add_argument("--latent", default="16x3x16x16", help="C×T×H×W of the empty latent")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cfg", type=float, default=5.0)
    ap.add_argument("--sampler", default="euler")
    ap.add_argument("--scheduler", default="simple")
    ap.add_argument("--pairs", type=int, default=None,
                    help="prompt pairs to measure (default 60; cheap: as many as the budget can start)")
    ap.add_argument("--prompts", default=None, help="a text file: one prompt per line, or 'A || B' pairs")
    ap.add_argument("--traffic-prompts", default=None, metavar="FILE",
                    help="prompts worded as your users write (same format as --prompts): as many pairs "
                         "again are made from them, and every budget is certified on them and on the "
                         "--prompts pairs alike (a budget holds on each, not only on their mix)")
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=None, help="the Carnator cache folder (default: ComfyUI's)")
    ap.add_argument("--low-noise-model", default=None,
                    help="Wan 2.2 A14B: the low-noise expert (--model is the high-noise one)")
    ap.add_argument("--switch-step", type=int, default=0,
                    help="with --low-noise-model: the first low-noise step (0: by --switch-sigma)")
    ap.add_argument("--switch-sigma", type=float, default=0.875)
    ap.add_argument("--probe-fraction", type=float, default=None,
                    help="the samplers' probe_fraction this calibration is for (it holds for that probe only; "
                         "default: the samplers' default, cheap: the transferred ranking's)")
    ap.add_argument("--fill-on-m", action="store_true",
                    help="measure hits that compute an edit's region M along its own trajectory on its "
                         "tokens (the gate then does it on every hit of this model)")
    ap.add_argument("--region-margin", type=int, default=0, metavar="TILES",
                    help="with --fill-on-m: widen an edit's region M by this many tiles")
    ap.add_argument("--budget-generations", type=float, default=0.0, metavar="B",
                    help="stop starting new pairs once B generation-equivalents are spent (1 = one full "
                         "generation at --steps and --latent; a pair costs about 2 + 7); what was measured "
                         "is fitted, and the same command with a larger B continues. 0: no limit")
    ap.add_argument("--served-latent", default=None, metavar="CxTxHxW",
                    help="the latent you generate, when --latent is a smaller proxy: --budget-generations and "
                         "the report count generations of this size (by token rows)")
    ap.add_argument("--procedure", choices=("generic", "cheap"), default="generic",
                    help="generic: every depth of every pair, the ranking fitted here (thousands of "
                         "generation-equivalents); cheap: the ranking of --transfer kept, only its thresholds "
                         "certified here, within --budget-generations (carnator_core/calibration/cheap.py)")
    ap.add_argument("--transfer", default=None, metavar="JSON",
                    help="with --procedure cheap: the calibration whose ranking is kept (default: the bundled "
                         "tiny world's, models/calibration/0706ef2962b7…probe0.05.json)")
    ap.add_argument("--demo-models", action="store_true",
                    help="calibrate the bundled tiny models into models/calibration/")
    ap.add_argument("--only", nargs="+", choices=sorted(DEMO), default=None,
                    help="with --demo-models: only these (the others' entries are kept)")
    a = ap.parse_args()
    from comfy_host import import_comfy
    import_comfy()
    prompts = Path(a.prompts).read_text() if a.prompts else ""
    if a.demo_models:
        if a.procedure != "generic":
            ap.error("--demo-models runs the generic calibration")
        out = ROOT / "models" / "calibration"
        listing = out / "demo_models.json"
        summary = json.loads(listing.read_text()) if a.only and listing.is_file() else {}
        tiny = lambda stem: str(ROOT / "models" / "tiny" / f"carnator_tiny_{stem}.safetensors")  # noqa: E731
        for backbone in a.only or list(DEMO):
            high, low = DEMO_EXPERTS.get(backbone, (backbone, None))
            # the cache folder's calibration/ subfolder is where files land: use models/ itself
            rep = calibrate_one(tiny(high), DEMO[backbone], DEMO_STEPS, DEMO_CFG, DEMO_PAIRS[backbone],
                                prompts, str(out.parent), probe_fraction=a.probe_fraction or DEFAULT_PROBE_FRACTION,
                                low_noise_model=tiny(low) if low else None,
                                switch_step=DEMO_STEPS // 2 if low else 0,
                                budget_generations=a.budget_generations)
            summary[backbone] = {"fingerprint": rep["model_fingerprint"], "pairs": rep["pairs"],
                                 "measured_reuses": rep["measured_reuses"],
                                 "exceeded_tolerance": rep["exceeded_tolerance"],
                                 "thresholds": rep["thresholds"], "heldout": rep["heldout"]}
        listing.write_text(json.dumps(summary, indent=1) + "\n")
        return 0
    if not a.model:
        ap.error("--model (or --demo-models) is required")
    import comfy.sd
    clip = None
    if a.clip:
        clip = comfy.sd.load_clip(ckpt_paths=a.clip, clip_type=getattr(comfy.sd.CLIPType, a.clip_type.upper()))
    vae = None
    if a.vae:
        import comfy.utils
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(a.vae))
    cache = a.cache
    if cache is None:
        from carnator_core.comfy_adapter import default_cache_folder
        cache = default_cache_folder()
    probe = a.probe_fraction if a.procedure == "cheap" else (a.probe_fraction or DEFAULT_PROBE_FRACTION)
    calibrate_one(a.model, a.latent, a.steps, a.cfg, a.pairs, prompts, cache, clip, vae, a.psnr_bound,
                  a.sampler, a.scheduler, a.seed, a.low_noise_model, a.switch_step, a.switch_sigma,
                  probe, a.fill_on_m, a.region_margin, a.budget_generations, a.procedure, a.transfer,
                  a.served_latent, Path(a.traffic_prompts).read_text() if a.traffic_prompts else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
