"""Carnator nodes for ComfyUI (V3 schema)."""
from comfy_api.latest import ComfyExtension, io

from .pipeline_nodes import (CarnatorCacheLookup, CarnatorCompatibilityGate, CarnatorEarlyProbe,
                             CarnatorReuseSampler)
from .calibrate_node import CarnatorCalibrate
from .sampler_node import CarnatorSampler
from .utility_nodes import (CarnatorCache, CarnatorDemoTextEncode, CarnatorTinyWorldDecode,
                            CarnatorTinyWorldTextEncode)

NODES: list[type[io.ComfyNode]] = [
    CarnatorEarlyProbe, CarnatorCacheLookup, CarnatorCompatibilityGate, CarnatorReuseSampler,
    CarnatorSampler, CarnatorCache, CarnatorDemoTextEncode, CarnatorTinyWorldTextEncode, CarnatorTinyWorldDecode,
    CarnatorCalibrate,
]


class CarnatorExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES
