"""Turn node input values into core settings objects."""
from ..carnator_core.gate import GateSettings
from ..carnator_core.pipeline import ReuseSettings


def reuse_settings(probe_fraction: float, snapshot_count: int | None = None, **gate) -> ReuseSettings:
    return ReuseSettings(probe_fraction=probe_fraction, snapshot_count=snapshot_count or 6,
                         gate=gate_settings(**gate))


def gate_settings(risk_budget: float = 0.05, min_depth: float | None = None,
                  max_depth: float | None = None, max_region: float | None = None) -> GateSettings:
    d = GateSettings()
    return GateSettings(risk_budget=risk_budget,
                        min_depth=d.min_depth if min_depth is None else min_depth,
                        max_depth=d.max_depth if max_depth is None else max_depth,
                        max_region_fraction=d.max_region_fraction if max_region is None else max_region)
