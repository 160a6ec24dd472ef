"""Carnator's attention composed with another: chained, never replaced, and named in the summary.

ComfyUI 0.38's Model Sparse Attention node (comfy_extras/nodes_sparse_attention.py, read in
Comfy-Org/ComfyUI; it needs comfy_kitchen's CUDA kernels and a newer host than the tests run)
is reproduced here by its calling convention: ``override(func, q, k, v, heads, mask=None,
attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)`` chaining to
the override under it, put on the hook when applied and again before every step's model calls
on top of whatever is there unless it is one of its own (``install_override``, run from an
ON_PREPARE_STATE callback under the key ``block_sparse_attention``). 0.3.75 calls that callback
without the sampling options, so the per-step re-installation runs from a CALC_COND_BATCH
wrapper, at the point of ``_calc_cond_batch`` where 0.38 calls ``prepare_state``.
"""
import comfy.ldm.modules.attention as comfy_attention
import comfy.patcher_extension
import pytest
import torch
from conftest import Requests

from carnator_core.reuse.sparse_attention import reset_sparse_call_counts, sparse_call_counts

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
KEY = "optimized_attention_override"


class SparseNode:
    """The 0.38 node's installation and decisions; its kernel (CUDA only) is ComfyUI's dense
    attention here, counted as the node's sparse calls."""

    def __init__(self, min_tokens: int = 1):
        self.min_tokens = min_tokens
        self.installed = set()
        self.calls = {"sparse": 0, "dense": 0}

    def make_override(self, previous):
        def override(func, q, k, v, heads, mask=None, attn_precision=None,
                     skip_reshape=False, skip_output_reshape=False, **kwargs):
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            tokens = q.shape[2] if skip_reshape else q.shape[1]
            if mask is not None or tokens < self.min_tokens or q.shape != k.shape:
                self.calls["dense"] += 1  # cross-attention and short sequences: dense
                return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
            self.calls["sparse"] += 1
            return func(q, k, v, heads, **kw)

        return override

    def install(self, transformer_options: dict) -> None:
        current = transformer_options.get(KEY)
        if current in self.installed:
            return
        override = self.make_override(current)
        self.installed.add(override)
        transformer_options[KEY] = override

    def apply(self, model):
        m = model.clone()
        self.install(m.model_options.setdefault("transformer_options", {}))

        def every_step(model_patcher, timestep, model_options=None):
            if model_options is not None:  # 0.38 passes the sampling options
                self.install(model_options["transformer_options"])

        def before_the_model_calls(executor, model_, conds, x_in, timestep, model_options):
            self.install(model_options.setdefault("transformer_options", {}))
            return executor(model_, conds, x_in, timestep, model_options)

        m.add_callback_with_key("on_prepare_state", "block_sparse_attention", every_step)
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.CALC_COND_BATCH,
                               "block_sparse_attention", before_the_model_calls)
        return m


def hit_through(model, folder, **sparse):
    requests = Requests(folder)
    requests.settings.sparse.keep_mass = 0.5
    requests.settings.sparse.max_density = 1.0
    for name, value in sparse.items():
        setattr(requests.settings.sparse, name, value)
    _, first = requests(model, "wan21", PROMPT)
    assert first.outcome == "miss", first.text()
    requests.settings.store = False
    return requests, lambda: requests(model, "wan21", RELATED)[1]


def test_a_hit_runs_carnator_sparse_on_top_of_comfyuis_sparse_node(tiny_models, tmp_path):
    node = SparseNode()
    model = node.apply(tiny_models["wan21"])
    _, hit = hit_through(model, tmp_path)
    reset_sparse_call_counts()
    node.calls = {"sparse": 0, "dense": 0}
    s = hit()
    assert s.outcome == "hit" and s.sparse_calls > 0, s.text()
    assert sum(sparse_call_counts().values()) == s.sparse_calls  # Carnator's kernel ran
    assert len(node.installed) > 1  # the node re-installed itself on top, step after step
    # every call Carnator left dense (cross-attention, the probe's self-attention) went to
    # the node, none that Carnator made sparse; the node ran its own sparse on the self ones
    layers = s.sparse_calls // (s.steps_total - s.reuse_step)
    handed = node.calls["sparse"] + node.calls["dense"]
    assert handed == layers * (2 * s.steps_computed) - s.sparse_calls, (node.calls, s.sparse_calls)
    assert node.calls["sparse"] > 0 and node.calls["dense"] > 0
    assert s.attention == (f"attention: Carnator block-sparse on {s.sparse_calls} calls, chained to "
                           f"ComfyUI's Model Sparse Attention for the other {handed}")
    assert s.attention in s.text()


def test_with_carnators_sparse_off_the_node_runs_every_call(tiny_models, tmp_path):
    node = SparseNode()
    _, hit = hit_through(node.apply(tiny_models["wan21"]), tmp_path, enabled=False)
    node.calls = {"sparse": 0, "dense": 0}
    s = hit()
    assert s.outcome == "hit" and s.sparse_calls == 0
    assert node.calls["sparse"] > 0
    assert s.attention.endswith("(Carnator's sparse off)") and "Model Sparse Attention" in s.attention


class Choice(torch.nn.Module):
    """A checkpoint's per-layer attention as ComfyUI 0.38 loads it (a ``comfy_attention``
    module whose ``function`` the checkpoint's config chose); 0.3.75 has no such layers."""

    def __init__(self, function):
        super().__init__()
        self.function = function


@pytest.fixture
def per_layer_choice(tiny_models):
    net = tiny_models["wan21"].get_model_object("diffusion_model")
    seen = {"calls": 0}

    def checkpoints_attention(*args, **kwargs):
        seen["calls"] += 1
        return comfy_attention.attention_pytorch(*args, **kwargs)

    layers = [b.self_attn for b in net.blocks] + [b.cross_attn for b in net.blocks]
    for layer in layers:
        layer.comfy_attention = Choice(checkpoints_attention)
    try:
        yield seen
    finally:
        for layer in layers:
            del layer.comfy_attention


def test_a_checkpoints_per_layer_attention_runs_where_carnator_is_dense(tiny_models, tmp_path,
                                                                        per_layer_choice):
    users = {"calls": 0}

    def users_override(func, *args, **kwargs):
        users["calls"] += 1
        assert func.__name__ == "checkpoints_attention"  # handed the checkpoint's choice
        return func(*args, **kwargs)

    wan = tiny_models["wan21"].clone()
    wan.model_options.setdefault("transformer_options", {})[KEY] = users_override
    _, hit = hit_through(wan, tmp_path)
    per_layer_choice["calls"] = users["calls"] = 0
    s = hit()
    assert s.outcome == "hit" and s.sparse_calls > 0
    layers = s.sparse_calls // (s.steps_total - s.reuse_step)
    assert per_layer_choice["calls"] == users["calls"] == layers * (2 * s.steps_computed) - s.sparse_calls
    assert "then the checkpoint's per-layer attention (checkpoints_attention)" in s.attention
    assert "users_override" in s.attention
