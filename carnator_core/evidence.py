"""The gate's vocabulary: the evidence features a candidate is judged by, the evidence classes
and share cells that each keep their own certified thresholds, and the rules for how deep a
finish may start and what it costs."""
from __future__ import annotations

import math


FEATURES = ("outside_mean", "outside_max", "region_fraction", "depth_fraction", "similarity_gap")


EVIDENCE = tuple(k for k in FEATURES if k != "depth_fraction")
EVIDENCE_CLASSES = ("same_scene", "other")
# Same-scene evidence: the probes agree on (nearly) every tile and globally. A paraphrase
# moves 0.4% of the tiles and its global signature by < 0.5% (tiny world); an edit moves 15%.
SAME_SCENE_REGION = 0.02
SAME_SCENE_GAP = 0.005


def option_key(klass: str, finish_calls: int) -> str:
    """Where a class's thresholds for a finish live in ``RiskModel.thresholds`` (``klass`` an
    evidence class or a share cell of one, ``share_cell``)."""
    return f"{klass}:guided" if finish_calls else klass


def class_of_option(key: str) -> str:
    """The evidence class a thresholds key belongs to: ``other/75:guided`` → ``other``."""
    return key.split(":")[0].split("/")[0]


# Other evidence is certified apart by the share of the tokens the reuse computes itself
# (region M after widening, ``reuse_region``): a reuse that recomputes a sixth of the frame
# and one that recomputes all of it along a coarse fill from the probe are different reuses,
# and one threshold for both let the second through on the first's record. Measured at N = 50
# (the bundled calibration's pairs): deep reuses beyond tolerance were 12% with M at 25–50% of
# the tokens and 3% above 75%, where the pairs were mostly unrelated scenes, while editing
# sessions the calibration never saw failed there. Each cell keeps its own guarantee, and a
# cell its calibration could not certify is refused, not extrapolated to.
REGION_SHARE_BOUNDS = (0.25, 0.5, 0.75, 1.0)


# Near-scene evidence: other evidence within this multiple of both same-scene cut-offs. Of the
# traffic-worded scene pairs' 960 directions 173 land here (364 inside the cut-offs), of the
# bundled calibration's 1,760 only 16, all edits; a calibration may certify it as a cell of its
# own (``NEAR_SCENE_CELL``, off by default) rather than in the bin of its token share, whose
# other pairs are mostly edits. On the tiny world it gains nothing (docs/studies.md).
NEAR_SCENE_REACH = 2.0
NEAR_SCENE_CELL = "other/near"


def near_scene(features: dict[str, float]) -> bool:
    """Other evidence within ``NEAR_SCENE_REACH`` times both same-scene cut-offs."""
    return (evidence_class(features) == "other"
            and features["region_fraction"] <= NEAR_SCENE_REACH * SAME_SCENE_REGION
            and features["similarity_gap"] <= NEAR_SCENE_REACH * SAME_SCENE_GAP)


def share_cell(klass: str, share: float | None, bounds) -> str:
    """The certified cell of this evidence: the class itself, or for other evidence under a
    calibration with share bounds ``other/<upper bound in %>`` of the bin holding ``share``
    (unknown: the widest bin)."""
    if klass != "other" or not bounds:
        return klass
    share = 1.0 if share is None else float(share)
    upper = next((b for b in bounds if share <= float(b) + 1e-9), bounds[-1])
    return f"other/{round(float(upper) * 100)}"


def share_bin_text(cell: str, bounds) -> str:
    """``other/75`` → "other evidence recomputing 50–75% of the tokens"."""
    if "/" not in cell:
        return f"{cell.replace('_', '-')} evidence"
    if cell == NEAR_SCENE_CELL:
        return f"near-scene evidence (other, within {NEAR_SCENE_REACH:g}× the same-scene cut-offs)"
    upper = int(cell.split("/")[1])
    lower = max([round(float(b) * 100) for b in bounds if round(float(b) * 100) < upper], default=0)
    return f"other evidence recomputing {lower}–{upper}% of the tokens"


def finish_cost(k: int, steps: int, finish_calls: int, region_share: float = 0.0) -> float:
    """Model steps after k*: every remaining one, or the guided finish's calls — plus, for a
    finish that computes region M's tokens between its calls, those steps at M's share."""
    if not finish_calls:
        return steps - k
    calls = min(finish_calls, steps - k)
    return calls + (steps - k - calls) * region_share


# A finish that computes region M alone between its full calls may skip at most this many
# steps per call: its outside follows the candidate by the offset of the last full call, and
# M attends to the outside's keys and values of that call; both age with every skipped step.
# Measured (bench/studies/region_finish_study.py, 6 calls): 5.4% and 4.5% of reuses beyond tolerance
# resuming at k = 4 and 6 of 20 (14–16 steps left), 2.3% at k = 8 (12 left).
REGION_FINISH_STEPS_PER_CALL = 2


def finish_allows(k: int, steps: int, finish_calls: int, region: bool, measured_steps: int = 0) -> bool:
    """Whether this finish may start at k: a region finish only within the share of the
    trajectory it was measured on — where its calls are every ``REGION_FINISH_STEPS_PER_CALL``-th
    step of the ``measured_steps`` (0: not recorded, the steps as they are). 4 calls span the
    last 8 of 20 steps, so the last 12 of 30 and 20 of 50 (``finish_calls_at`` adds calls
    there), as the gate's depths transfer to another N by their share of it."""
    if not (finish_calls and region):
        return True
    span = REGION_FINISH_STEPS_PER_CALL * finish_calls
    if measured_steps:
        span *= steps / measured_steps
    return steps - k <= span + 1e-9


def finish_calls_at(k: int, steps: int, finish_calls: int, region: bool) -> int:
    """The full calls this finish makes from k: a region finish keeps at most
    ``REGION_FINISH_STEPS_PER_CALL`` steps between its calls at any N. Keeping instead the
    σ a call spans (4 calls at N = 50, a call every 5 steps) left 9 of 56 other-evidence
    hits on `iterate` at k = 30 of 50 below 30 dB, against 3 finished every step (at N = 30,
    every 3 steps: 4 of 57 against 3); M's outside ages with the steps it skips, not σ alone."""
    if not (finish_calls and region):
        return finish_calls
    return max(finish_calls, math.ceil((steps - k) / REGION_FINISH_STEPS_PER_CALL))


def evidence_class(features: dict[str, float]) -> str:
    """The class whose certified thresholds apply: each class keeps its own guarantee, so
    the budget holds however a workload mixes paraphrases and edits."""
    same = (features["region_fraction"] <= SAME_SCENE_REGION
            and features["similarity_gap"] <= SAME_SCENE_GAP)
    return "same_scene" if same else "other"
