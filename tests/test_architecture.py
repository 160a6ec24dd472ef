"""The core's parts and who may import whom (docs/architecture.md): no import cycle in
carnator_core, counting imports inside functions too (a lazy import that dodges a cycle
is still one), and nothing under cache/ or calibration/ knows the ComfyUI adapter."""
import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "carnator_core"
ADAPTER = "carnator_core.comfy_adapter"


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The carnator_core modules a file imports, wherever the import statement stands."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # "from . import x": x may be a module
                found.add(f"{target}.{alias.name}" if _is_module(f"{target}.{alias.name}") else target)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {n for n in names if n.startswith("carnator_core")}
    return {m for m in found if _is_module(m) and m != here}


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (CORE / rel).with_suffix(".py").is_file() or (CORE / rel / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in CORE.rglob("*.py")}


def test_carnator_core_has_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " → ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2
    for m in sorted(g):
        if m not in state:
            visit(m)


def test_cache_and_calibration_never_import_the_comfyui_adapter():
    g = graph()
    offenders = {m: sorted(d for d in deps if d == ADAPTER or d.startswith(ADAPTER + "."))
                 for m, deps in g.items() if m.startswith(("carnator_core.cache", "carnator_core.calibration"))}
    offenders = {m: deps for m, deps in offenders.items() if deps}
    assert not offenders, offenders


def test_each_step_of_the_method_has_its_place():
    for part in ("signature.py", "gate.py", "pipeline.py", "comfy_adapter/__init__.py", "cache/folder.py",
                 "cache/postgres.py", "calibration/fit.py", "calibration/generic.py",
                 "reuse/sparse_reuse.py", "reuse/region_compute.py"):
        assert (CORE / part).is_file(), part
    assert not [p.name for p in CORE.glob("cache_*.py")]  # the cache lives in cache/


def test_each_module_is_short_enough_to_read():
    """About 500 lines a module; a cache backend, which is one thing, may run a little over."""
    long = {str(p.relative_to(CORE)): n for p in CORE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 560}
    assert not long, long
