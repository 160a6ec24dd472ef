"""Carnator next to other model patches: ComfyUI's own EasyCache and a real LoRA load."""
import logging

import torch

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"


def _with_lora(model, rank=4, scale=0.05):
    """Apply a small LoRA through ComfyUI's own loader path (what LoraLoaderModelOnly does)."""
    import comfy.lora
    import comfy.sd
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    sd = model.model.state_dict()
    g = torch.Generator().manual_seed(3)
    lora = {}
    for lora_key, model_key in key_map.items():
        if not (isinstance(model_key, str) and lora_key.startswith("lora_unet_")
                and model_key.endswith("self_attn.q.weight")):
            continue
        out_f, in_f = sd[model_key].shape
        lora[f"{lora_key}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * scale
        lora[f"{lora_key}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * scale
    assert lora, "no LoRA-able attention weights found"
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    return patched


def test_lora_patched_model_gets_another_fingerprint_and_no_reuse(tiny_models, requests_in):
    from carnator_core.comfy_adapter import model_fingerprint
    wan = tiny_models["wan21"]
    lora = _with_lora(wan)
    assert lora.patches, "the LoRA did not patch any weight"
    assert model_fingerprint(lora) != model_fingerprint(wan)
    assert model_fingerprint(wan.clone()) == model_fingerprint(wan)  # clones share identity

    _, s1 = requests_in(wan, "wan21", PROMPT)
    out, s2 = requests_in(lora, "wan21", PROMPT)  # same prompt and seed, LoRA on top
    assert s1.outcome == "miss" and s2.outcome == "miss"
    assert "none for this model" in s2.lookup_message
    assert torch.isfinite(out).all()


def test_pipeline_runs_with_comfyui_easycache_on_the_model(tiny_models, requests_in, caplog):
    from comfy_extras.nodes_easycache import EasyCacheNode
    from carnator_core.comfy_adapter import model_fingerprint
    wan = tiny_models["wan21"]
    eased = EasyCacheNode.execute(wan, 0.2, 0.15, 0.95, False).result[0]
    # EasyCache changes what the model computes: its trajectories are their own class
    assert model_fingerprint(eased) != model_fingerprint(wan)

    with caplog.at_level(logging.INFO):
        first, s1 = requests_in(eased, "wan21", PROMPT)
        second, s2 = requests_in(eased, "wan21", RELATED)
    assert s1.outcome == "miss"
    assert s2.outcome == "hit", s2.text()
    assert s2.model_calls < s2.steps_total
    assert torch.isfinite(second).all() and second.shape == first.shape
    # EasyCache's own OUTER_SAMPLE wrapper ran inside our segments (it logs a summary each time)
    assert any("EasyCache - skipped" in r.getMessage() for r in caplog.records)


def test_easycache_thresholds_are_different_models_to_reuse_between(tiny_models, requests_in):
    """A calibration, and entries, made at one EasyCache threshold must not serve another:
    the fingerprint reads EasyCache's settings, not only its wrapper names."""
    from comfy_extras.nodes_easycache import EasyCacheNode
    from carnator_core.comfy_adapter import model_fingerprint
    wan = tiny_models["wan21"]
    ease = lambda threshold, verbose=False: EasyCacheNode.execute(wan, threshold, 0.15, 0.95, verbose).result[0]  # noqa: E731
    at_002, at_005 = ease(0.02), ease(0.05)
    assert model_fingerprint(at_002) != model_fingerprint(at_005)
    assert model_fingerprint(ease(0.02)) == model_fingerprint(at_002)  # the same node, run again
    assert model_fingerprint(ease(0.02, verbose=True)) == model_fingerprint(at_002)  # a log switch
    before = model_fingerprint(at_002)

    _, s1 = requests_in(at_002, "wan21", PROMPT)  # sampling leaves the holder's settings as they were
    assert model_fingerprint(at_002) == before
    _, s2 = requests_in(at_005, "wan21", PROMPT)  # same prompt and seed, another threshold
    _, s3 = requests_in(at_002, "wan21", PROMPT)  # the first threshold again: its own entry, exactly
    assert s1.outcome == "miss" and s2.outcome == "miss", s2.text()
    assert "none for this model" in s2.lookup_message
    assert s3.outcome == "exact", s3.text()


def test_rope_scaling_is_part_of_the_fingerprint(tiny_models):
    """ComfyUI's ScaleROPE node keeps its scales in transformer_options (a dict, no wrapper):
    each scaling is its own model, and the default scaling one model with itself."""
    from comfy_extras.nodes_rope import ScaleROPE
    from carnator_core.comfy_adapter import model_fingerprint
    wan = tiny_models["wan21"]
    rope = lambda scale_t: ScaleROPE.execute(wan, 1.0, 0.0, 1.0, 0.0, scale_t, 0.0).result[0]  # noqa: E731
    assert model_fingerprint(rope(2.0)) != model_fingerprint(rope(1.5))
    assert model_fingerprint(rope(2.0)) == model_fingerprint(rope(2.0))
    assert model_fingerprint(rope(2.0)) != model_fingerprint(wan)


def test_an_fp8_checkpoint_gets_a_fingerprint_and_runs(tiny_models, requests_in):
    """UNETLoader's weight_dtype fp8_e4m3fn (how fp8 Wan checkpoints are usually run): the
    fingerprint hashes float8 weights (numpy has no float8) and a request runs and hits."""
    import comfy.sd
    from carnator_core.comfy_adapter import model_fingerprint
    from conftest import REPO
    fp8 = comfy.sd.load_diffusion_model(str(REPO / "models" / "tiny" / "carnator_tiny_wan21.safetensors"),
                                        model_options={"dtype": torch.float8_e4m3fn})
    dtypes = {v.dtype for v in fp8.model.diffusion_model.state_dict().values()}
    assert torch.float8_e4m3fn in dtypes
    assert model_fingerprint(fp8) != model_fingerprint(tiny_models["wan21"])  # other weights
    first, s1 = requests_in(fp8, "wan21", PROMPT)
    second, s2 = requests_in(fp8, "wan21", RELATED)
    assert s1.outcome == "miss" and s2.outcome == "hit", s2.text()
    assert torch.isfinite(second).all()


def test_tensor_digest_keeps_its_bytes_and_reads_float8():
    """Every digest made before (numpy's bytes; bfloat16 as its int16 bits) is unchanged, so
    no fingerprint or calibration file name moves; float8 values are hashed too."""
    import hashlib
    from carnator_core.keys import tensor_digest
    g = torch.Generator().manual_seed(0)
    for t, raw in ((x := torch.randn(300, generator=g), x.numpy()),
                   (y := torch.randn(300, generator=g).to(torch.bfloat16), y.view(torch.int16).numpy()),
                   (z := torch.arange(50), z.numpy())):
        old = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}".encode())
        old.update(raw.tobytes())
        assert tensor_digest(t) == old.hexdigest()
    a = torch.randn(64, generator=g).to(torch.float8_e4m3fn)
    b = (a.float() * 2).to(torch.float8_e4m3fn)
    assert tensor_digest(a) == tensor_digest(a.clone()) != tensor_digest(b)
    assert tensor_digest(a, max_values=8) != tensor_digest(b, max_values=8)


class _BypassLoras:
    """How ComfyUI's LoraLoaderBypass applies LoRAs (comfy/weight_adapter/bypass.py, newer
    than the vendored host): a manager of {layer: (adapter, strength)} whose one
    PatcherInjection closes over it; neither the weights nor ``model.patches`` change."""

    def __init__(self):
        self.adapters = {}

    def add_adapter(self, key, adapter, strength=1.0):
        self.adapters[key] = (adapter, strength)

    def create_injections(self, model):
        from comfy.patcher_extension import PatcherInjection

        def inject_all(model_patcher):
            return self

        def eject_all(model_patcher):
            return self
        return [PatcherInjection(inject=inject_all, eject=eject_all)]


def _bypassed(model, strength, scale=0.05):
    from comfy.weight_adapter.lora import LoRAAdapter
    g = torch.Generator().manual_seed(5)
    manager = _BypassLoras()
    for name, w in model.model.diffusion_model.state_dict().items():
        if name.endswith("self_attn.q.weight"):
            up, down = torch.randn(w.shape[0], 4, generator=g) * scale, torch.randn(4, w.shape[1], generator=g) * scale
            manager.add_adapter(f"diffusion_model.{name[:-7]}", LoRAAdapter(set(), (up, down, None, None, None, None)),
                                strength)
    assert manager.adapters
    patched = model.clone()
    patched.set_injections("bypass_lora", manager.create_injections(patched.model))
    return patched


def test_bypass_loras_and_other_injections_get_their_own_fingerprint(tiny_models):
    from comfy.patcher_extension import PatcherInjection
    from carnator_core.comfy_adapter import model_fingerprint
    wan = tiny_models["wan21"]
    base = model_fingerprint(wan)
    full, half = _bypassed(wan, 1.0), _bypassed(wan, 0.5)
    assert not full.patches  # invisible to the weight-patch path
    assert model_fingerprint(full) != base and model_fingerprint(half) != base
    assert model_fingerprint(full) != model_fingerprint(half)  # the strength counts
    assert model_fingerprint(_bypassed(wan, 1.0)) == model_fingerprint(full)  # content, not identity
    opaque = wan.clone()
    opaque.set_injections("another_pack", [PatcherInjection(inject=lambda m: None, eject=lambda m: None)])
    assert model_fingerprint(opaque) != base
    assert model_fingerprint(wan.clone()) == base


def test_a_node_that_re_installs_its_attention_each_step_is_chained_not_refused(tiny_models,
                                                                                requests_in):
    """Newer ComfyUI's Model Sparse Attention re-installs its override on top of any other at
    every step (an ON_PREPARE_STATE callback under its key): Carnator keeps its own on top,
    hands the calls it leaves dense to that node, and the summary names it
    (tests/test_attention_chain.py runs the node's calling convention); other callbacks only
    make the model another fingerprint."""
    from carnator_core.comfy_adapter import model_fingerprint
    wan = tiny_models["wan21"]
    takeover = wan.clone()
    takeover.add_callback_with_key("on_prepare_state", "block_sparse_attention", lambda *a: None)
    _, s = requests_in(takeover, "wan21", PROMPT)
    assert s.outcome == "miss" and "Model Sparse Attention" in s.text()
    other = wan.clone()
    other.add_callback_with_key("on_prepare_state", "some_pack", lambda *a: None)
    assert model_fingerprint(other) != model_fingerprint(wan)
    _, s = requests_in(other, "wan21", PROMPT)
    assert s.outcome == "miss"
