"""What a calibration costs, in *generation-equivalents*.

The unit is one full generation at the calibrated size and steps: N steps × all the latent's
tokens × the cond/uncond passes the sampler runs = 1.0. A reuse resumed at depth k of N costs
(N − k)/N, plus its fill of region M and any calls on M's tokens alone at their share of the
tokens. A calibration pair costs its two full runs (2.0) plus every reuse measured on it.

The count is *measured* where it can be: ``comfy_adapter.attach_meter`` counts the token rows
entering the model's last transformer block into a ``ComputeMeter`` (a call skipped by
EasyCache never gets there, a call on M's tokens brings only those), and a pair's rows are
divided by the rows of its own first full run. Where the model's blocks are unknown, or for
measurement records written before the meter, ``pair_cost`` applies the same rule to the
records. Plain Python: no torch, no ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..keys import shape_str


class ComputeMeter:
    """Token rows the model computed, as a hook at its last block reports them
    (``comfy_adapter.attach_meter``); ``available`` once a block list was found."""

    def __init__(self) -> None:
        self.rows = 0
        self.available = False

    def add(self, rows: int) -> None:
        self.rows += int(rows)

    def steps(self, rows: int, rows_per_step: float) -> float | None:
        """``rows`` in model steps of a full computation (None when nothing can be counted)."""
        return rows / rows_per_step if self.available and rows_per_step else None


# ------------------------------------------------------------------ the rule, on records
def reuse_steps(depth: dict, steps: int) -> float:
    """Model steps (of the whole frame) one measured reuse computed, from its record: the
    steps after its depth k — all of them; a guided finish's computed ones (its
    ``predicted_steps`` are not computed); a region finish's full calls plus its calls on M's
    tokens at ``token_share`` — plus the fill of M (``fill_steps``: full calls plus calls on
    M's tokens at their share, as ``pipeline.Fill.steps`` counts them)."""
    after = steps - int(depth["k"])
    region = int(depth.get("region_steps") or 0)
    if region:
        finish = after - region + region * float(depth.get("token_share") or 0.0)
    else:
        finish = after - int(depth.get("predicted_steps") or 0)
    return finish + float(depth.get("fill_steps") or 0.0)


def pair_cost(instances: list[dict], steps: int) -> float:
    """Generation-equivalents of one measured pair by the rule: the two full runs (request
    and candidate) and every reuse measured in either direction."""
    return 2.0 + sum(reuse_steps(d, steps) for inst in instances for d in inst["depths"]) / steps


def at_served_size(generations: float, calibrated_tokens: int, served_tokens: int) -> float:
    """Generation-equivalents counted at one size, in generations of another: a calibration run
    at a proxy size (fewer frames, fewer pixels) costs its token rows, and one generation at the
    served size brings ``served_tokens`` rows per call. Token rows, not FLOPs: attention grows
    with the square of the tokens, so this overstates a smaller size's share of the arithmetic;
    on real hardware a small size's calls are overhead-bound, which this understates."""
    if calibrated_tokens <= 0 or served_tokens <= 0:
        raise ValueError(f"token counts must be positive, got {calibrated_tokens} and {served_tokens}")
    return generations * calibrated_tokens / served_tokens


@dataclass(frozen=True)
class ServedSize:
    """The latent size a calibration's user serves, when it measures at a smaller one (a
    proxy): its budget and its report count model work in generations of this size."""
    latent: tuple[int, int, int]      # frames × height × width, in latent units
    token_share: float                # the calibrated latent's tokens over this one's

    @classmethod
    def of(cls, calibrated: tuple[int, ...], served: tuple[int, ...]) -> "ServedSize":
        cal_cells, served_cells = _cells(calibrated), _cells(served)
        return cls(tuple(served), at_served_size(1.0, cal_cells, served_cells))

    def generations(self, at_calibrated_size: float) -> float:
        return at_calibrated_size * self.token_share


def _cells(latent: tuple[int, ...]) -> int:
    if len(latent) != 3 or any(int(n) <= 0 for n in latent):
        raise ValueError(f"a latent size is three positive counts (frames, height, width), got {latent}")
    return int(latent[0]) * int(latent[1]) * int(latent[2])


# ------------------------------------------------------------------ one calibration's ledger
@dataclass
class PairCost:
    generations: float
    seconds: float | None = None   # None: not timed (measured before the meter)
    by: str = "meter"              # "meter" (counted at the model) or "rule" (from the records)

    def as_dict(self) -> dict:
        return {"generations": round(self.generations, 4), "by": self.by,
                **({"seconds": round(self.seconds, 2)} if self.seconds is not None else {})}

    @classmethod
    def of(cls, row: dict | None, instances: list[dict], steps: int) -> "PairCost":
        """A progress line's stored cost, or the rule's for a line written without one."""
        got = (row or {}).get("cost") or {}
        if got.get("generations") is not None:
            return cls(float(got["generations"]), got.get("seconds"), got.get("by", "meter"))
        return cls(pair_cost(instances, steps), None, "rule")


@dataclass
class CostLedger:
    """What one calibration spends: pairs carried from its progress file and pairs measured
    now, against an optional budget (0: none), with the ETA of the pairs left. With ``served``
    the budget is in generations of the served size, and what is spent is counted there too."""
    budget_generations: float = 0.0
    served: ServedSize | None = None
    pairs_planned: int = 0
    carried: list[PairCost] = field(default_factory=list)
    measured: list[PairCost] = field(default_factory=list)
    stopped_by_budget: bool = False
    pairs_skipped: int = 0          # pairs the budget left unmeasured

    @property
    def spent(self) -> float:
        return sum(c.generations for c in self.carried + self.measured)

    def in_budget_unit(self, generations: float) -> float:
        """Generation-equivalents at the calibrated size in the budget's unit (the served
        size's generations where given)."""
        return self.served.generations(generations) if self.served else generations

    @property
    def spent_against_budget(self) -> float:
        return self.in_budget_unit(self.spent)

    @property
    def exhausted(self) -> bool:
        return self.budget_generations > 0 and self.spent_against_budget >= self.budget_generations

    def carry(self, done: dict[str, dict], pair_ids: list[str], steps: int) -> None:
        """Count what the pairs measured before (in ``done``, the progress file) cost, each
        pair once however often it is listed."""
        for pid in dict.fromkeys(pair_ids):
            if pid in done:
                self.carried.append(PairCost.of(done[pid], done[pid]["instances"], steps))

    def skip_if_spent(self) -> bool:
        """Whether the budget is spent; if so the pair about to start is skipped and counted."""
        if not self.exhausted:
            return False
        self.stopped_by_budget = True
        self.pairs_skipped += 1
        return True

    def per_pair(self) -> tuple[float | None, float | None]:
        """(generation-equivalents, seconds) per pair, from the pairs measured in this run
        (their machine), else from the carried ones that have them."""
        for pool in (self.measured, self.carried):
            timed = [c.seconds for c in pool if c.seconds is not None]
            if pool:
                cost = sum(c.generations for c in pool) / len(pool)
                return cost, (sum(timed) / len(timed) if timed else None)
        return None, None

    def progress_line(self, done: int, left: int) -> str:
        """After a pair: what was spent, and what the pairs left will cost and take."""
        last = self.measured[-1]
        cost, secs = self.per_pair()
        line = (f"calibration: pair {done} of {self.pairs_planned} measured, "
                f"{last.generations:.2f} generation-equivalents"
                + (f" in {last.seconds:.0f} s" if last.seconds is not None else "")
                + f"; spent {self.spent:.1f}"
                + (f" ({self.spent_against_budget:.1f} at the served size)" if self.served else "")
                + (f" of a budget of {self.budget_generations:g}" if self.budget_generations > 0 else ""))
        if left and cost:
            line += (f"; {_pairs(left)} left ≈ {left * cost:.0f} generation-equivalents"
                     + (f", ETA {_duration(left * secs)}" if secs is not None else "")
                     + f" (from {_pairs(len(self.measured))} measured: {cost:.2f} per pair"
                     + (f", {secs:.0f} s per pair)" if secs is not None else ")"))
            if self.budget_generations > 0:
                room = max(0.0, self.budget_generations - self.spent_against_budget)
                fits = min(left, int(-(-room // self.in_budget_unit(cost))))  # the pair that crosses it is finished
                if fits == 0:
                    line += "; the budget is spent: no new pair is started"
                elif fits < left:
                    line += f"; the budget stops it after about {_pairs(fits)} more"
        return line

    def as_dict(self, steps_seconds: float | None = None) -> dict:
        cost, secs = self.per_pair()
        return {
            "cost_generations": round(self.spent, 3),
            "this_run_generations": round(sum(c.generations for c in self.measured), 3),
            "carried_generations": round(sum(c.generations for c in self.carried), 3),
            "pairs_measured_now": len(self.measured), "pairs_carried": len(self.carried),
            "pairs_by_rule": sum(c.by == "rule" for c in self.carried + self.measured),
            "pairs_planned": self.pairs_planned, "pairs_skipped": self.pairs_skipped,
            "generations_per_pair": None if cost is None else round(cost, 3),
            "seconds_per_pair": None if secs is None else round(secs, 2),
            "measuring_seconds": round(sum(c.seconds or 0.0 for c in self.carried + self.measured), 1),
            "budget_generations": self.budget_generations, "stopped_by_budget": self.stopped_by_budget,
            **({"served": {"latent": list(self.served.latent), "token_share": round(self.served.token_share, 6),
                           "cost_generations": round(self.spent_against_budget, 3)}} if self.served else {}),
        }


def _pairs(n: int) -> str:
    return f"{n} pair" + ("s" if n != 1 else "")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def cost_text(report: dict) -> list[str]:
    """The report's lines on cost and budget, for a person."""
    cost = report.get("cost") or {}
    if not cost:
        return []
    spent = cost["cost_generations"]
    size = shape_str(report["latents"][-1]) if report.get("latents") else ""
    lines = [f"cost: {spent:.1f} generation-equivalents (1.0 = one full generation at these steps "
             f"and size{f', latent {size} (frames×height×width)' if size else ''}; "
             f"{cost['this_run_generations']:.1f} in this run, "
             f"{cost['carried_generations']:.1f} carried from the progress file), "
             f"{report.get('seconds', 0):.0f} s wall in this run"
             + (f"; {cost['pairs_by_rule']} pairs measured before the meter counted by rule"
                if cost.get("pairs_by_rule") else "")]
    served = cost.get("served")
    if served:
        lines.append(f"at the served size, latent {shape_str(served['latent'])}: "
                     f"{served['cost_generations']:.1f} generation-equivalents of that size (this calibration's "
                     f"latent has {served['token_share']:.1%} of its tokens; counted by token rows, not FLOPs)"
                     + (f"; the budget of {cost['budget_generations']:g} is counted there"
                        if cost.get("budget_generations") else ""))
    if cost.get("stopped_by_budget"):
        done = cost["pairs_planned"] - cost["pairs_skipped"]
        lines.append(f"stopped by the budget of {cost['budget_generations']:g} generation-equivalents"
                     + (" of the served size" if served else "")
                     + f" after {done} of {cost['pairs_planned']} pairs (the pair that crossed it was finished: "
                     f"spent {served['cost_generations'] if served else spent:.1f}); the results above use those "
                     f"{_pairs(done)}. Run it "
                     "again with a larger budget and it continues where it stopped: measured pairs and "
                     "their cost are kept in the progress file")
    return lines
