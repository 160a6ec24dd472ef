"""Carnator core: the method in plain torch/numpy.

Everything here is testable without ComfyUI, except `comfy_adapter`, the one module that
knows ComfyUI's API. Import submodules directly (``from carnator_core.cache import ...``).
"""
__version__ = "0.1.0"
