"""Make the real ComfyUI host importable from tests, scripts and benchmarks.

    from tests.comfy_host import import_comfy      # or: import comfy_host (tests/ on sys.path)
    import_comfy()
    import comfy.sd, comfy.sample                   # the real ComfyUI 0.3.75 modules

Where the host is looked for, first match wins:
  1. the ``path`` argument,
  2. the ``COMFYUI_PATH`` environment variable,
  3. the first line of ``<repo>/.host/path`` (written by scripts/provision.sh),
  4. ``<repo>/.host/ComfyUI``.

CPU is forced by default (``comfy.cli_args.args.cpu = True`` before ``comfy.model_management``
is imported, exactly as ComfyUI's own tests-unit do). ComfyUI's argument parser is off unless
``comfy.options.enable_args_parsing()`` was called, so pytest's own argv does not leak in.
Set ``CARNATOR_COMFY_GPU=1`` (or pass ``force_cpu=False``) to let ComfyUI pick a GPU.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def host_path(path: str | os.PathLike | None = None) -> Path:
    """Folder of the ComfyUI host (the one holding ``comfy/`` and ``folder_paths.py``)."""
    candidates = []
    if path:
        candidates.append(Path(path))
    if os.environ.get("COMFYUI_PATH"):
        candidates.append(Path(os.environ["COMFYUI_PATH"]))
    marker = REPO_ROOT / ".host" / "path"
    if marker.is_file():
        first = marker.read_text().strip().splitlines()
        if first and first[0].strip():
            candidates.append(Path(first[0].strip()))
    candidates.append(REPO_ROOT / ".host" / "ComfyUI")
    for c in candidates:
        if (c / "comfy" / "model_management.py").is_file():
            return c.resolve()
    raise FileNotFoundError(
        "No ComfyUI host found (tried: %s). Run scripts/provision.sh or set COMFYUI_PATH."
        % ", ".join(str(c) for c in candidates))


def import_comfy(path: str | os.PathLike | None = None, force_cpu: bool | None = None) -> None:
    """Put the ComfyUI host first on sys.path and select the CPU (unless told otherwise).

    Idempotent. Raises RuntimeError if ``comfy.model_management`` was already imported
    with a non-CPU device while CPU was asked for (the choice is made at import time).
    """
    if force_cpu is None:
        force_cpu = os.environ.get("CARNATOR_COMFY_GPU", "") not in ("1", "true", "yes")
    root = str(host_path(path))
    if root not in sys.path:
        sys.path.insert(0, root)
    if force_cpu:
        from comfy.cli_args import args
        args.cpu = True
        mm = sys.modules.get("comfy.model_management")
        if mm is not None and not mm.cpu_mode():
            raise RuntimeError("comfy.model_management was imported before import_comfy() "
                               "without --cpu; call import_comfy() first")
    import comfy.model_management  # noqa: F401  (fixes the device choice now)


def host_nodes():
    """ComfyUI's own ``nodes.py`` (KSampler, KSamplerAdvanced, ...), for reference runs.

    Loaded by file under the name ComfyUI gives it: this pack's own ``nodes`` package shadows
    it whenever the repository root comes before the host on sys.path.
    """
    import importlib.util
    module = sys.modules.get("nodes")
    if module is not None and hasattr(module, "KSamplerAdvanced"):
        return module
    spec = importlib.util.spec_from_file_location("nodes", host_path() / "nodes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodes"] = module
    spec.loader.exec_module(module)
    return module
