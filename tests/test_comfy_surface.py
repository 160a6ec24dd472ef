"""The installed ComfyUI host offers every symbol, keyword and key the pack relies on
(the list, and the releases it was read against, are in comfy_surface.py)."""
import importlib
import inspect

import pytest
from comfy_host import host_path
from comfy_surface import SURFACE, TESTED


def _resolve(module: str, dotted: str):
    obj = importlib.import_module(module)
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _accepts(func, keyword: str) -> bool:
    params = inspect.signature(func).parameters
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values()) and keyword in (
        inspect.getsource(func))


@pytest.mark.parametrize("kind,where,what,read", SURFACE, ids=[f"{w}:{x}"[:90] for _, w, x, _ in SURFACE])
def test_the_host_offers_what_the_pack_uses(kind, where, what, read):
    assert read.startswith(TESTED)
    if kind == "attr":
        _resolve(where, what)
    elif kind == "param":
        func, keyword = what.split(":")
        assert _accepts(_resolve(where, func), keyword), f"{where}.{func} takes no {keyword}"
    else:
        source = (host_path() / where).read_text()
        assert what in source, f"{where} no longer has {what}"


def test_the_list_names_every_comfy_module_the_adapter_imports():
    """A new import in the adapter must come with its entries here."""
    from pathlib import Path
    adapter = "\n".join(f.read_text() for f in
                        (Path(__file__).resolve().parent.parent / "carnator_core" / "comfy_adapter").glob("*.py"))
    listed = {where for kind, where, _, _ in SURFACE if kind != "literal"}
    imported = {line.split()[1] for line in adapter.splitlines()
                if line.strip().startswith("import comfy") and len(line.split()) >= 2}
    imported |= {line.split()[1] for line in adapter.splitlines()
                 if line.strip().startswith("from comfy") and " import " in line}
    assert imported <= listed | {"comfy.ldm.wan.model"}, imported - listed
