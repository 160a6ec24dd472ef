"""Input declarations shared by several nodes (one place for their tooltips and ranges)."""
from comfy_api.latest import io

from ..carnator_core.comfy_adapter import SAMPLER_NAMES, SCHEDULER_NAMES
from ..carnator_core.reuse.experts import WAN22_SWITCH_SIGMA
from ..carnator_core.gate import DEFAULT_PROBE_FRACTION, GateSettings
from .types import CacheConfig


def sampling_inputs() -> list:
    """KSampler's inputs, with KSampler's names so workflows convert easily."""
    return [
        io.Model.Input("model", tooltip="The video diffusion model (any loader, LoRA and patches included: they are part of the cache key)."),
        io.Conditioning.Input("positive", tooltip="What the video should show."),
        io.Conditioning.Input("negative", tooltip="What the video should avoid."),
        io.Latent.Input("latent_image", tooltip="The empty video latent that sets size and length."),
        io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                     tooltip="Noise seed. Under the same_seed policy only entries with this seed are reused."),
        io.Int.Input("steps", default=30, min=2, max=10000, tooltip="Denoising steps N."),
        io.Float.Input("cfg", default=5.0, min=0.0, max=100.0, step=0.1, round=0.01,
                       tooltip="Classifier-free guidance scale."),
        io.Combo.Input("sampler_name", options=SAMPLER_NAMES, default="euler",
                       tooltip="Sampler. Single-step samplers (euler) resume exactly; multistep ones restart their history at the resume step."),
        io.Combo.Input("scheduler", options=SCHEDULER_NAMES, default="simple",
                       tooltip="Sigma schedule; part of the compatibility class."),
    ]


def probe_inputs() -> list:
    return [
        io.Float.Input("probe_fraction", default=DEFAULT_PROBE_FRACTION, min=0.02, max=0.5, step=0.01,
                       tooltip="Share of the steps the Early Probe runs for real (at least one). The probe steps belong to the request: a miss just continues from them. A calibration holds for the probe it was measured with (Carnator Calibrate's probe_fraction); with another, the gate uses the uncalibrated prior."),
        io.Combo.Input("seed_policy", options=["same_seed", "shared_noise"], default="same_seed", optional=True,
                       tooltip="same_seed: reuse only entries made with this seed (interactive). shared_noise: requests draw noise from a small pool of canonical seeds so more of them are comparable (serving)."),
        io.Int.Input("snapshot_count", default=7, min=1, max=64, optional=True,
                     tooltip="How many intermediate latents x_k this request stores for later reuse."),
        io.String.Input("label", default="", optional=True,
                        tooltip="Text shown for this request in the cache browser. Empty: the request's own prompt (the text of the encoder feeding positive)."),
        CacheConfig.Input("cache", optional=True,
                          tooltip="Cache folder and capacity from a 'Carnator Cache' node; default: carnator_cache in ComfyUI's user directory."),
    ]


def gate_inputs() -> list:
    return [
        io.Float.Input("risk_budget", default=0.05, min=0.0, max=1.0, step=0.005,
                       tooltip="α: the largest accepted probability that reuse makes the video deviate beyond tolerance from a full computation."),
        io.Float.Input("min_depth", default=0.2, min=0.0, max=1.0, step=0.05, optional=True,
                       tooltip="Shallowest reuse step k*, as a share of the steps."),
        io.Float.Input("max_depth", default=0.8, min=0.0, max=1.0, step=0.05, optional=True,
                       tooltip="Deepest reuse step k*, as a share of the steps."),
        io.Float.Input("max_region", default=0.5, min=0.0, max=1.0, step=0.05, optional=True,
                       tooltip="Reject when more than this share of the video must be recomputed."),
    ]


def finish_inputs() -> list:
    """Last on its nodes, so workflows saved before it keep their widget positions."""
    return [
        io.Boolean.Input("guided_finish", default=True, optional=True,
                         tooltip="A same-scene hit may compute only a few of the steps after k* and follow the matched entry's stored trajectory between them — where this model's calibration certified that finish at your risk budget and it computes less (else every step runs)."),
        io.Float.Input("min_saving", default=0.0, min=0.0, max=0.95, step=0.05, optional=True,
                       tooltip="Reuse only when it saves at least this share of the steps; otherwise compute in full and become a source (only requests computed in full are reused later). Default 0: every certified reuse runs. On the bundled tiny world's popular-prompt workload every hit at α = 5% saves more than half, so 0.5 changes nothing there; at α = 2% it runs most requests in full."),
        io.Boolean.Input("recurring_sources", default=GateSettings.recurring_sources, optional=True,
                         tooltip="When a scene is asked again and its first request was served by reusing another scene (so it is no source), compute this one in full so the scene's later requests reuse their own scene — only where that reuse is certified and cheaper. Keep on when editing: off, a session returning to a scene repeats a failing reuse. A service without editing sessions computes fewer steps with it off (more, shallower hits)."),
    ]


def audit_inputs() -> list:
    return [
        io.Float.Input("audit_rate", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Share of hits also computed in full to measure the false-accept rate against α on your traffic (each audited hit costs one full generation). 0: the CARNATOR_AUDIT_RATE environment variable, else off."),
        io.Vae.Input("vae", optional=True,
                     tooltip="Only for audits of a model calibrated on decoded frames: the same VAE."),
    ]


def explore_inputs() -> list:
    """Last on its nodes, so workflows saved before it keep their widget positions."""
    return [
        io.Float.Input("explore_rate", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Share of requests that the next certified threshold would reuse deeper (or would reuse where the gate does not) that are explored: computed and served in full, and that deeper reuse also run and measured, so audits can certify it and the gate can then go deeper on your traffic. Costs compute (about one full generation per explored request), never quality: you always get the full result. Needs a calibrated model; 0: off."),
    ]


def sparse_inputs() -> list:
    return [
        io.Boolean.Input("sparse_attention", default=True, optional=True,
                         tooltip="Run the remaining steps of a hit with block-sparse self-attention, using the attention connectivity stored with the matched entry."),
        io.Float.Input("keep_mass", default=0.9, min=0.05, max=1.0, step=0.01, optional=True,
                       tooltip="Share of the attention mass each query block keeps when this request's connectivity is stored. Lower is faster and less exact."),
        io.Float.Input("min_density", default=0.1, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Each query block keeps at least this share of key blocks."),
        io.Int.Input("refresh_every", default=0, min=0, max=1000, optional=True,
                     tooltip="0: reuse the stored connectivity for every remaining step. N>0: every N steps run dense and re-measure this request's own connectivity."),
        io.Boolean.Input("sparse_on_miss", default=False, optional=True,
                         tooltip="On a miss, run the remaining steps sparse with the probe's own connectivity."),
    ]


def expert_inputs() -> list:
    """Wan 2.2 A14B's second expert and where it takes over (last, so older workflows keep
    their widget order)."""
    return [
        io.Model.Input("low_noise_model", optional=True,
                       tooltip="Wan 2.2 A14B: the low-noise expert (the high-noise one goes to model). Steps from the switch on run on it, exactly as two chained KSamplerAdvanced nodes would; both experts and the switch are part of the cache key. Leave empty for one model."),
        io.Int.Input("switch_step", default=0, min=0, max=10000, optional=True,
                     tooltip="With low_noise_model: the first step the low-noise expert runs (the end_at_step of your first KSamplerAdvanced). 0: switch at the first step whose sigma is below switch_sigma."),
        io.Float.Input("switch_sigma", default=WAN22_SWITCH_SIGMA, min=0.0, max=1.0, step=0.005, optional=True,
                       tooltip="With low_noise_model and switch_step 0: switch to the low-noise expert at the first step whose sigma falls below this (Wan 2.2 text-to-video: 0.875; image-to-video: 0.9)."),
    ]
