"""Custom socket types passed between Carnator nodes."""
from comfy_api.latest import io

Probe = io.Custom("CARNATOR_PROBE")
Candidates = io.Custom("CARNATOR_CANDIDATES")
Plan = io.Custom("CARNATOR_PLAN")
CacheConfig = io.Custom("CARNATOR_CACHE")


def node_id_of(node_cls) -> str | None:
    """The running node's id (None when execute() is called outside ComfyUI's executor)."""
    hidden = getattr(node_cls, "hidden", None)
    return getattr(hidden, "unique_id", None)
