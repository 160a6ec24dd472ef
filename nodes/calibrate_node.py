"""CarnatorCalibrate: calibrate the gate on the connected model."""
from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io

from ..carnator_core.calibration import cheap
from ..carnator_core.calibration import pairs as prompt_pairs
from ..carnator_core.comfy_adapter import (SAMPLER_NAMES, SCHEDULER_NAMES, calibrate_model, model_file_names,
                                           default_cache_folder)
from ..carnator_core.calibration.generic import report_text
from ..carnator_core.calibration.status import remember_model_names
from ..carnator_core.calibration.tolerance import Tolerance
from ..carnator_core.reuse.experts import WAN22_SWITCH_SIGMA
from ..carnator_core.gate import DEFAULT_PROBE_FRACTION, RiskModel
from .inputs import expert_inputs
from .settings import reuse_settings
from .types import CacheConfig, node_id_of

# the pack's bundled calibrations, where the cheap procedure finds the ranking it keeps
BUNDLED_CALIBRATIONS = Path(__file__).resolve().parent.parent / "models" / "calibration"


class CarnatorCalibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCalibrate", display_name="Carnator Calibrate", category="Carnator",
            description=("Makes the risk budget α a promise on this model: computes prompt pairs in full, "
                         "reuses each at every depth the gate may choose, labels every reuse by PSNR against "
                         "the request's own full computation, and writes the calibration the gate loads for "
                         "this model. Long on a real model (each pair costs about 2 + 7 generations; the report "
                         "says what it cost, and budget_generations caps it); interrupted or stopped by the "
                         "budget, it resumes where it stopped."),
            inputs=[
                io.Model.Input("model", tooltip="The model to calibrate, exactly as your workflows load it (LoRAs and patches included)."),
                io.Latent.Input("latent_image", tooltip="An empty latent of the size and length you generate. A smaller one costs its share of the tokens; the file records the size, and larger requests are told α was measured at a smaller size (docs/calibration.md)."),
                io.Clip.Input("clip", optional=True, tooltip="The model's text encoder. Without it the pack's demo text encoder is used (bundled demo models only)."),
                io.Vae.Input("vae", optional=True, tooltip="Judge reuses on decoded frames. Without it, on the latent. Audits must then get the same VAE."),
                io.String.Input("prompts", multiline=True, default="",
                                tooltip="Your own prompts, one per line (pairs are derived from them by rewording, colour and direction edits, objects added or removed); 'A || B' is a pair as given. Empty: a built-in list."),
                io.Int.Input("pairs", default=60, min=4, max=10000, tooltip="Prompt pairs to measure. Certifying α = 5% needs a few hundred reuses per evidence class."),
                io.Int.Input("first_seed", default=0, min=0, max=0xFFFFFFFF, tooltip="Pair i runs with seed first_seed + i (both requests of a pair share it)."),
                io.Int.Input("steps", default=30, min=4, max=1000, tooltip="Steps N, as in your workflows."),
                io.Float.Input("cfg", default=5.0, min=0.0, max=100.0, step=0.1, round=0.01),
                io.Combo.Input("sampler_name", options=SAMPLER_NAMES, default="euler"),
                io.Combo.Input("scheduler", options=SCHEDULER_NAMES, default="simple"),
                io.Float.Input("psnr_bound", default=30.0, min=5.0, max=80.0, step=0.5,
                               tooltip="A reuse is beyond tolerance when its PSNR against the request's own full computation is below this (dB)."),
                io.Boolean.Input("include_audits", default=True, tooltip="Also fit on the live audits this cache holds for the model."),
                CacheConfig.Input("cache", optional=True, tooltip="Where the calibration is written (the cache the sampler uses)."),
            ] + expert_inputs() + [
                io.Float.Input("probe_fraction", default=DEFAULT_PROBE_FRACTION, min=0.02, max=0.5, step=0.01, optional=True,
                               tooltip="The probe to calibrate for: the samplers' probe_fraction. A calibration holds for this probe only; calibrate once per probe you use."),
                io.Boolean.Input("fill_region_on_its_tokens", default=False, optional=True,
                                 tooltip="On a hit, compute region M (what the request changes) along its own trajectory on M's tokens instead of a coarse estimate: a few more model calls on part of the tokens, deeper reuse for edits. The calibration measures it, and hits of this model then do it."),
                io.Int.Input("region_margin", default=0, min=0, max=4, optional=True,
                             tooltip="With fill_region_on_its_tokens: widen an edit's region M by this many tiles in space and time, so changes just outside what the probe saw are computed too."),
                io.Combo.Input("procedure", options=["full", "cheap"], default="full", optional=True,
                               tooltip="full: every depth of every pair measured and the risk model fitted on this model. cheap: the bundled tiny world's risk ranking kept and only its thresholds certified here, on the decisions the gate would take (with its recipe: probe_fraction 0.05, region M on its own tokens); about 200 generation-equivalents certified same-scene reuse at α = 10% on the tiny world, and edits are refused until enough labels exist (the report says how many more)."),
                io.Float.Input("budget_generations", default=0.0, min=0.0, max=1e7, step=1.0, optional=True,
                               tooltip="Stop measuring new pairs once this much model work is spent, in generation-equivalents (1 = one full generation at these steps and size, or at served_latent's size when connected; a pair costs about 2 + 7). The pair in progress is finished, what was measured is fitted, and running it again with a larger budget continues. 0: no limit."),
                io.Latent.Input("served_latent", optional=True,
                                tooltip="An empty latent of the size you generate, when latent_image is a smaller proxy: budget_generations and the report count model work in generations of this size (by token rows). The calibration is still measured at latent_image's size, and requests of this size are told so."),
                io.String.Input("traffic_prompts", multiline=True, default="", optional=True,
                                tooltip="Prompts worded as your users write (same format as prompts; full procedure only). As many pairs again are made from them, and every budget is certified on them and on the prompts' pairs alike: α then holds on each, not only on their mix. Empty: one population."),
            ],
            outputs=[io.String.Output("report", tooltip="Pairs and reuses measured, certified budgets, the held-out check.")],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, latent_image, prompts, pairs, first_seed, steps, cfg, sampler_name,
                scheduler, psnr_bound, include_audits, clip=None, vae=None,
                cache=None, low_noise_model=None, switch_step=0,
                switch_sigma=WAN22_SWITCH_SIGMA, probe_fraction=DEFAULT_PROBE_FRACTION,
                fill_region_on_its_tokens=False, region_margin=0, procedure="full",
                budget_generations=0.0, served_latent=None, traffic_prompts="") -> io.NodeOutput:
        folder = (cache or {}).get("folder") or default_cache_folder()
        transferred, text_of = None, report_text
        if procedure == "cheap" and (traffic_prompts or "").strip():
            raise ValueError("traffic_prompts works with procedure 'full': the cheap procedure certifies "
                             "one population of pairs; clear traffic_prompts or choose 'full'")
        if procedure == "cheap":  # the ranking's own recipe: its evidence means what it meant there
            transferred = RiskModel.load(BUNDLED_CALIBRATIONS / cheap.BUNDLED_RANKING)
            settings = cheap.settings_for(transferred, probe_fraction)
            chosen, text_of = cheap.pool_from_text(prompts, pairs, seed=first_seed), cheap.report_text
        else:
            settings = reuse_settings(probe_fraction=probe_fraction)
            settings.region_fill_on_m = bool(fill_region_on_its_tokens)
            settings.region_margin = int(region_margin) if fill_region_on_its_tokens else 0
            chosen = prompt_pairs.pairs_from_texts(prompts, traffic_prompts, pairs, seed=first_seed)
        tolerance = Tolerance(psnr_bound, "frames" if vae is not None else "latent")
        _, report = calibrate_model(model, clip, latent_image, chosen, steps, cfg, sampler_name,
                                    scheduler, tolerance, folder, settings, vae=vae, seed=first_seed,
                                    include_audits=include_audits, node_id=node_id_of(cls),
                                    low_noise_model=low_noise_model, switch_step=switch_step,
                                    switch_sigma=switch_sigma, budget_generations=budget_generations,
                                    procedure="cheap" if transferred is not None else "generic",
                                    transferred=transferred, served_latent=served_latent)
        names = model_file_names(cls.hidden.prompt, node_id_of(cls))
        if names and report.get("model_fingerprint"):  # the cache tab names it as it was loaded
            remember_model_names(folder, report["model_fingerprint"], names)
        text = text_of(report)
        return io.NodeOutput(text, ui={"text": [text]})
