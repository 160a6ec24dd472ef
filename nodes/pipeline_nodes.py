"""The four pipeline nodes: Early Probe → Cache Lookup → Compatibility Gate → Reuse Sampler.

Declarations only: each execute() hands its inputs to carnator_core and returns what it gets.
"""
from __future__ import annotations

from dataclasses import dataclass

from comfy_api.latest import io

from ..carnator_core import pipeline
from ..carnator_core.cache.backend import database_location
from ..carnator_core.cache.folder import LookupResult
from ..carnator_core.comfy_adapter import frames_decoder, model_file_names, notify, prompt_text_of, start_request
from ..carnator_core.reuse.experts import WAN22_SWITCH_SIGMA
from ..carnator_core.gate import Plan as GatePlan
from .inputs import (audit_inputs, expert_inputs, explore_inputs, finish_inputs, gate_inputs,
                     probe_inputs, sampling_inputs, sparse_inputs)
from .settings import audit_rate_or_default, gate_settings, reuse_settings, sparse_settings
from .types import CacheConfig, Candidates, Plan, Probe, node_id_of


@dataclass
class CandidatesBundle:
    probe: pipeline.ProbeResult
    found: LookupResult


@dataclass
class PlanBundle:
    probe: pipeline.ProbeResult
    plan: GatePlan
    verdicts: list[GatePlan]


class CarnatorEarlyProbe(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorEarlyProbe", display_name="Carnator Early Probe", category="Carnator",
            description="Runs the request's own first denoising steps and reads its Early Signature from the model's internal states. An exact repeat of a stored request is answered here without computing anything.",
            inputs=sampling_inputs() + probe_inputs() + expert_inputs(),
            outputs=[Probe.Output("probe", tooltip="The probe: the request, its first steps and its signature.")],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
        )

    @classmethod
    def execute(cls, model, positive, negative, latent_image, seed, steps, cfg, sampler_name,
                scheduler, probe_fraction, seed_policy="same_seed", snapshot_count=None, label="",
                cache=None, low_noise_model=None, switch_step=0,
                switch_sigma=WAN22_SWITCH_SIGMA) -> io.NodeOutput:
        settings = reuse_settings(probe_fraction, snapshot_count)
        label = label or prompt_text_of(cls.hidden.prompt, node_id_of(cls))
        result = start_request(model, positive, negative, latent_image, seed, steps, cfg,
                               sampler_name, scheduler, settings, cache, seed_policy, label,
                               node_id=node_id_of(cls), low_noise_model=low_noise_model,
                               switch_step=switch_step, switch_sigma=switch_sigma,
                               model_names=model_file_names(cls.hidden.prompt, node_id_of(cls)))
        return io.NodeOutput(result)


class CarnatorCacheLookup(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCacheLookup", display_name="Carnator Cache Lookup", category="Carnator",
            description="Finds stored trajectories of the same model, shape, schedule and seed, ranked by Early Signature similarity.",
            inputs=[
                Probe.Input("probe", tooltip="From Carnator Early Probe."),
                io.Int.Input("top_k", default=3, min=1, max=32, tooltip="How many candidates the gate examines."),
                CacheConfig.Input("cache", optional=True, tooltip="Search this cache instead of the probe's (also where the result is stored)."),
            ],
            outputs=[Candidates.Output("candidates", tooltip="Ranked candidates with their similarity.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, probe, top_k, cache=None) -> io.NodeOutput:
        if cache is not None:
            location = database_location(cache.get("database")) or cache["folder"]
            probe.cache, probe.cache_message = pipeline.open_cache(location, cache["capacity_bytes"])
        notify("phase", {"phase": "lookup"}, node_id_of(cls))
        return io.NodeOutput(CandidatesBundle(probe, pipeline.lookup(probe, top_k)))


class CarnatorCompatibilityGate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCompatibilityGate", display_name="Carnator Compatibility Gate", category="Carnator",
            description="Decides, within your risk budget, whether a candidate can be reused, from which step, and which regions the request must compute itself.",
            inputs=[Candidates.Input("candidates", tooltip="From Carnator Cache Lookup.")] + gate_inputs()
            + finish_inputs(),
            outputs=[Plan.Output("plan", tooltip="Accept or reject, reuse step k*, region and predicted risk."),
                     io.String.Output("summary", tooltip="The decision in words.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, candidates, risk_budget, min_depth=None, max_depth=None,
                max_region=None, guided_finish=None, min_saving=None,
                recurring_sources=None) -> io.NodeOutput:
        pr = candidates.probe
        notify("phase", {"phase": "gate"}, node_id_of(cls))
        settings = gate_settings(risk_budget, min_depth, max_depth, max_region, guided_finish, min_saving,
                                 recurring_sources)
        # an unusable calibration file gives the prior (which says why), never a failure
        plan, verdicts = pipeline.gate(pr, candidates.found, pipeline.calibrated_risk_model(pr),
                                       settings) if pr.cache is not None else (
            GatePlan(False, reason=pr.cache_message or "cache unavailable"), [])
        text = (f"accept entry {plan.entry_id[:8]} at k*={plan.reuse_step}/{pr.run.steps}, "
                f"risk {plan.risk:.1%}, region {plan.region_fraction:.0%}" if plan.accept
                else plan.reason if pr.exact_latent is not None  # not a rejection: the best outcome
                else f"no reuse: {plan.reason}")
        return io.NodeOutput(PlanBundle(pr, plan, verdicts), text)


class CarnatorReuseSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorReuseSampler", display_name="Carnator Reuse Sampler", category="Carnator",
            description="Finishes the request: resumes from the stored latent on a hit, continues the probe on a miss, and stores the new trajectory.",
            inputs=([Plan.Input("plan", tooltip="From Carnator Compatibility Gate.")] + sparse_inputs()
                    + audit_inputs() + explore_inputs()),
            outputs=[io.Latent.Output("LATENT", tooltip="The denoised video latent."),
                     io.String.Output("summary", tooltip="Hit or miss, k*, steps computed of N, risk, matched entry.")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, plan, audit_rate=None, vae=None, explore_rate=None, **sparse) -> io.NodeOutput:
        plan.probe.settings.sparse = sparse_settings(**sparse)
        plan.probe.settings.audit_rate = audit_rate_or_default(audit_rate)
        plan.probe.settings.explore_rate = explore_rate or 0.0
        plan.probe.decode = frames_decoder(vae)
        return finish(plan.probe, plan.plan, node_id_of(cls))


def finish(pr: pipeline.ProbeResult, plan: GatePlan, node_id) -> io.NodeOutput:
    """Run the rest of the request and report it to the page and the history."""
    notify("phase", {"phase": "reuse" if plan.accept else "sample"}, node_id)
    samples, summary = pipeline.reuse(pr, plan)
    pr.run.finish_progress()
    info = summary.as_dict()
    notify("result", info, node_id)
    return io.NodeOutput({"samples": samples}, summary.text(), ui={"carnator": [info]})
