"""Turn node input values into core settings objects."""
from ..carnator_core.comfy_adapter import audit_rate_default
from ..carnator_core.gate import GateSettings
from ..carnator_core.pipeline import ReuseSettings
from ..carnator_core.reuse.sparse_reuse import SparseSettings


def sparse_settings(sparse_attention=None, keep_mass=None, min_density=None, refresh_every=None,
                    sparse_on_miss=None) -> SparseSettings:
    d = SparseSettings()
    pick = lambda v, default: default if v is None else v  # noqa: E731 - optional inputs
    return SparseSettings(enabled=pick(sparse_attention, d.enabled), keep_mass=pick(keep_mass, d.keep_mass),
                          min_density=pick(min_density, d.min_density),
                          refresh_every=pick(refresh_every, d.refresh_every),
                          on_miss=pick(sparse_on_miss, d.on_miss))


def reuse_settings(probe_fraction: float, snapshot_count: int | None = None,
                   audit_rate: float | None = None, explore_rate: float | None = None,
                   **gate) -> ReuseSettings:
    return ReuseSettings(probe_fraction=probe_fraction, snapshot_count=snapshot_count or ReuseSettings.snapshot_count,
                         gate=gate_settings(**gate), audit_rate=audit_rate_or_default(audit_rate),
                         explore_rate=explore_rate or 0.0)


def audit_rate_or_default(rate: float | None) -> float:
    """The node's audit rate, or the operator's CARNATOR_AUDIT_RATE when the node says 0."""
    return rate if rate else audit_rate_default()


def gate_settings(risk_budget: float = 0.05, min_depth: float | None = None,
                  max_depth: float | None = None, max_region: float | None = None,
                  guided_finish: bool | None = None, min_saving: float | None = None,
                  recurring_sources: bool | None = None) -> GateSettings:
    d = GateSettings()
    return GateSettings(risk_budget=risk_budget,
                        min_depth=d.min_depth if min_depth is None else min_depth,
                        max_depth=d.max_depth if max_depth is None else max_depth,
                        max_region_fraction=d.max_region_fraction if max_region is None else max_region,
                        guided_finish=d.guided_finish if guided_finish is None else guided_finish,
                        min_saving=d.min_saving if min_saving is None else min_saving,
                        recurring_sources=(d.recurring_sources if recurring_sources is None
                                           else recurring_sources))
