"""CarnatorSampler: the whole pipeline in one node with KSampler's inputs."""
from __future__ import annotations

from comfy_api.latest import io

from ..carnator_core import pipeline
from ..carnator_core.comfy_adapter import model_file_names, notify, prompt_text_of, start_request
from ..carnator_core.reuse.experts import WAN22_SWITCH_SIGMA
from .inputs import (audit_inputs, expert_inputs, explore_inputs, finish_inputs, gate_inputs,
                     probe_inputs, sampling_inputs, sparse_inputs)
from .pipeline_nodes import finish
from .settings import reuse_settings, sparse_settings
from .types import node_id_of


class CarnatorSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorSampler", display_name="Carnator Sampler", category="Carnator",
            description="A KSampler that reuses compatible earlier requests: probe, lookup, gate and reuse in one node.",
            inputs=(sampling_inputs() + probe_inputs() + gate_inputs() + sparse_inputs()
                    + audit_inputs() + expert_inputs() + finish_inputs() + explore_inputs()),
            outputs=[io.Latent.Output("LATENT", tooltip="The denoised video latent."),
                     io.String.Output("summary", tooltip="Hit or miss, k*, steps computed of N, risk, matched entry.")],
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, positive, negative, latent_image, seed, steps, cfg, sampler_name,
                scheduler, probe_fraction, risk_budget, seed_policy="same_seed",
                snapshot_count=None, label="", cache=None, min_depth=None, max_depth=None,
                max_region=None, audit_rate=None, vae=None, low_noise_model=None, switch_step=0,
                switch_sigma=WAN22_SWITCH_SIGMA, guided_finish=None, min_saving=None, recurring_sources=None,
                explore_rate=None, **sparse) -> io.NodeOutput:
        node_id = node_id_of(cls)
        label = label or prompt_text_of(cls.hidden.prompt, node_id)
        settings = reuse_settings(probe_fraction, snapshot_count, audit_rate, risk_budget=risk_budget,
                                  min_depth=min_depth, max_depth=max_depth, max_region=max_region,
                                  guided_finish=guided_finish, min_saving=min_saving,
                                  recurring_sources=recurring_sources, explore_rate=explore_rate)
        settings.sparse = sparse_settings(**sparse)
        pr = start_request(model, positive, negative, latent_image, seed, steps, cfg,
                           sampler_name, scheduler, settings, cache, seed_policy, label, node_id,
                           vae=vae, low_noise_model=low_noise_model, switch_step=switch_step,
                           switch_sigma=switch_sigma,
                           model_names=model_file_names(cls.hidden.prompt, node_id))
        notify("phase", {"phase": "lookup"}, node_id)  # lookup and gate run back to back
        plan, _ = pipeline.lookup_and_gate(pr)
        return finish(pr, plan, node_id)
