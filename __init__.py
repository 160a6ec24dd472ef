"""Carnator — cross-request reuse for video diffusion transformers in ComfyUI.

ComfyUI loads this folder as a custom node pack: the nodes come from ``comfy_entrypoint``
(V3 node API) and the front-end extension from ``WEB_DIRECTORY``.
"""
from .nodes import CarnatorExtension
from .nodes import routes  # noqa: F401  (registers /carnator/ routes inside a running server)

WEB_DIRECTORY = "./web"


async def comfy_entrypoint() -> CarnatorExtension:
    return CarnatorExtension()
