"""Risk-aware Compatibility Gate (DESIGN.md §2.4).

Given the probe's signature and a candidate's signature at the same step, decide:
- the target-specific region M: tiles whose early evidence disagrees (recomputed fresh);
- the reuse depth k*: the deepest stored snapshot whose predicted risk fits the budget;
- the predicted risk: probability that reusing at k* deviates beyond tolerance from what
  the request would have produced from the same noise.

The risk model is a logistic function of a few evidence features. Its default weights are
an *uncalibrated* prior; ``RiskModel.fit`` (and the calibration command) replace them with
weights fitted on measured deviations for a given model fingerprint.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, asdict, fields as dataclass_fields
from pathlib import Path

import torch

from .reuse.region_compute import FILL_SEGMENT_STEPS
from .risk_model_check import FORMAT_VERSION, CalibrationRejected, check_calibration
from .signature import EarlySignature, tile_deviation, widen_tiles

log = logging.getLogger("carnator")

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


INTERACTION_EVIDENCE_SCALE = 0.01  # s(e) = log(1 + e/0.01): 0.4% of tiles and 15% far apart
# The evidence whose weights the signed form leaves free in sign. When M is filled on its own
# tokens (pipeline.fill_region), what M covers the request computes itself: the risk sits in
# what the probe did not put in M, so a larger M is *safer* (calibration: beyond tolerance at
# k = 12 of 20, 19% of other-evidence pairs with M under 5% of the tiles, 4% with M over 20%),
# and a monotone fit pins these weights at 0. Disagreement outside M and depth stay monotone.
SIGNED_FREE = ("region_fraction", "similarity_gap")
RISK_FORMS = ("linear", "interaction", "signed")


DEFAULT_PROBE_FRACTION = 0.1  # ReuseSettings' default; a calibration file without a probe is this one's


def same_probe(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) < 1e-6


def calibration_file(cache_folder: str | Path, model_fingerprint: str,
                     probe_fraction: float = DEFAULT_PROBE_FRACTION, steps: int = 0) -> Path:
    """Where a model's calibration for this probe lives: ``<fingerprint>.json`` for the
    default probe, ``<fingerprint>.probe<share>.json`` for another — the one used at any N.
    ``steps``: the name of one measured at that N beside it (``….n<steps>.json``), which the
    gate prefers at that N (calibration.save writes it when the first holds another N)."""
    name = model_fingerprint if same_probe(probe_fraction, DEFAULT_PROBE_FRACTION) \
        else f"{model_fingerprint}.probe{float(probe_fraction):g}"
    return Path(cache_folder) / "calibration" / (f"{name}.n{steps}.json" if steps else f"{name}.json")


# The names calibration_file gives: <fingerprint>[.probe<share>][.n<steps>].json
CALIBRATION_NAME = re.compile(r"([^.]+)(?:\.probe(\d*\.?\d+))?(?:\.n(\d+))?\.json")


def calibration_files(cache_folder: str | Path, model_fingerprint: str) -> list[tuple[float, int]]:
    """(probe_fraction, steps) of each calibration file this model has (steps 0: the general
    file, used at any N), under the names calibration_file gives only — not reports, progress
    files, or a name the gate would never read (e.g. "….probe0.050.json")."""
    folder = Path(cache_folder) / "calibration"
    found = []
    for p in folder.glob(f"{model_fingerprint}.*") if folder.is_dir() else ():
        m = CALIBRATION_NAME.fullmatch(p.name)
        if not (m and m.group(1) == model_fingerprint):
            continue
        probe = float(m.group(2)) if m.group(2) else DEFAULT_PROBE_FRACTION
        steps = int(m.group(3) or 0)
        if p == calibration_file(cache_folder, model_fingerprint, probe, steps):
            found.append((probe, steps))
    return sorted(found)


def calibrated_probes(cache_folder: str | Path, model_fingerprint: str) -> list[float]:
    """The probes this model has a general calibration file for."""
    return [probe for probe, steps in calibration_files(cache_folder, model_fingerprint) if not steps]


def calibrated_steps(cache_folder: str | Path, model_fingerprint: str) -> list[dict]:
    """The calibrations measured at one N beside the general ones (``….n<N>.json``), as
    ``{"probe_fraction", "steps"}``: the gate uses each at its N and probe only."""
    return [{"probe_fraction": probe, "steps": steps}
            for probe, steps in calibration_files(cache_folder, model_fingerprint) if steps]


@dataclass
class RiskModel:
    """P(deviation > tolerance | evidence e, depth d) = sigmoid(z), with

        z = bias + w_d·d + Σ weights[e]·s(e) + d · Σ depth_weights[e]·s(e)      (e ∈ EVIDENCE)

    The default (linear) form has no depth × evidence terms and raw evidence, s(e) = e. The
    opt-in interaction form (``fit(form="interaction")``) adds them, so depth costs little
    where the early evidence agrees (a paraphrase, a repeat) and a lot where it does not (an
    edit), with s(e) = log(1 + e/``evidence_scale``): evidence spans orders of magnitude — a
    paraphrase moves 0.4% of the tiles, an edit 15%. Its weights are all ≥ 0, so predicted
    risk never falls as reuse gets deeper or the evidence disagrees more. The ``signed`` form
    is the same function with the weights of M's size and the text gap free in sign (see
    ``SIGNED_FREE``), depth and the disagreement outside M ≥ 0, fitted on other evidence only
    (``calibration.fit``), the only reuses its logit ranks.
    """

    weights: dict[str, float] = field(default_factory=lambda: {
        "outside_mean": 10.0, "outside_max": 4.0, "region_fraction": 3.0,
        "depth_fraction": 3.0, "similarity_gap": 6.0})
    bias: float = -7.0
    region_threshold: float = 0.35  # tile deviation above which a tile joins M
    calibrated: bool = False
    source: str = "default prior (uncalibrated)"
    depth_weights: dict[str, float] = field(default_factory=dict)  # missing = 0 (older files)
    evidence_scale: float | None = None
    # Certified acceptance thresholds on ``score`` per evidence class and risk budget α
    # ({"same_scene": {"0.05": λ}, "other": {…}}), chosen by calibration.certify_model
    # (Learn-then-Test) with confidence ``confidence`` for each class. Empty: the gate compares
    # the predicted risk with α directly (the prior, older files).
    thresholds: dict[str, dict[str, float]] = field(default_factory=dict)
    confidence: float | None = None
    # What "beyond tolerance" meant when this model was calibrated ({"psnr_bound": dB,
    # "space": "frames" | "latent"}): live audits label reuses by the same rule.
    tolerance: dict | None = None
    measured_reuses: int = 0  # reuses behind the fit and the thresholds (0: the prior)
    # Classes whose reuses were also measured with a guided finish (guided_finish.py) of that
    # many model calls ({"same_scene": 3}); its thresholds are certified apart, under the key
    # option_key(class, calls). A class not named always finishes every remaining step.
    finish_calls: dict[str, int] = field(default_factory=dict)
    # Classes whose guided finish computes region M's tokens between its calls
    # (region_compute.py; {"other": True}), as their reuses were measured.
    finish_region: dict[str, bool] = field(default_factory=dict)
    # Whether the reuses were measured with region M filled by its own trajectory computed on
    # its tokens (pipeline.fill_region's segments); a hit fills M the same way.
    region_fill_on_m: bool = False
    # Tiles by which region M was widened, in space and time, for other evidence before the
    # reuses were measured (``reuse_region``); a hit widens it the same.
    region_margin: int = 0
    # The probe's share of the steps the reuses were measured with: evidence read after one
    # probe step is not the evidence read after two, so the thresholds hold for this probe
    # only (risk_model_for finds a calibration by fingerprint and probe). Files written
    # before this field were all measured with the default probe.
    probe_fraction: float = DEFAULT_PROBE_FRACTION
    # The steps N the reuses were measured with (0: not recorded). Depths transfer to another
    # N by their share of it; so does the span a region finish may cover (finish_allows).
    measured_steps: int = 0
    # Upper bounds of the bins of the token share a reuse with other evidence computes itself
    # (``REGION_SHARE_BOUNDS``): each bin's thresholds are certified apart (``share_cell``).
    # Empty: one class for all other evidence (files written before the bins).
    region_share_bounds: list[float] = field(default_factory=list)
    # Set on the prior that stands in for a calibration file found unusable: why (the file
    # and the field). Never saved; the status shows it wherever "calibrated" is shown.
    rejected: str | None = None

    def scaled(self, features: dict[str, float]) -> dict[str, float]:
        """The evidence as the weights see it (depth_fraction passes through)."""
        if self.evidence_scale is None:
            return dict(features)
        return {k: (v if k == "depth_fraction" else math.log1p(max(v, 0.0) / self.evidence_scale))
                for k, v in features.items()}

    def logit(self, features: dict[str, float]) -> float:
        f = self.scaled(features)
        d = f["depth_fraction"]
        return (self.bias + sum(self.weights[k] * f[k] for k in FEATURES)
                + d * sum(w * f[k] for k, w in self.depth_weights.items()))

    def risk(self, features: dict[str, float]) -> float:
        z = self.logit(features)
        return 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))

    def threshold_for(self, alpha: float, klass: str) -> tuple[float, float] | None:
        """(certified α', λ) of this evidence class for the largest certified α' ≤ α, or None
        when no certified budget is that strict (then nothing is accepted: the guarantee
        cannot be given)."""
        fits = [(float(a), lam) for a, lam in self.thresholds.get(klass, {}).items()
                if float(a) <= alpha + 1e-12]
        return max(fits) if fits else None

    def score(self, features: dict[str, float]) -> float:
        """What the certified thresholds compare, per evidence class: within same-scene
        evidence the depth alone (measured: how closely two paraphrases' probes agree does
        not predict which reuses fail, so ranking them by it certified nothing deep), else
        the logit."""
        if evidence_class(features) == "same_scene":
            return features["depth_fraction"]
        return self.logit(features)

    def cell(self, features: dict[str, float]) -> str:
        """The certified cell of this evidence: its class, split for other evidence by the
        token share the reuse computes itself (``features["reuse_share"]``)."""
        return share_cell(evidence_class(features), features.get("reuse_share"),
                          self.region_share_bounds)

    def accepts(self, features: dict[str, float], alpha: float, finish_calls: int = 0) -> bool:
        """The gate's test for one candidate at one depth under budget α, finished every
        step (``finish_calls`` 0) or by that guided finish."""
        if not self.thresholds:
            return not finish_calls and self.risk(features) <= alpha
        certified = self.threshold_for(alpha, option_key(self.cell(features), finish_calls))
        return certified is not None and self.score(features) <= certified[1] + 1e-9

    def class_finishes(self, klass: str) -> list[int]:
        """The finishes an evidence class's thresholds are certified for: every step (0), and
        the guided finish where the calibration measured it for the class."""
        calls = self.finish_calls.get(klass, 0)
        return [0, calls] if calls else [0]

    def finish_options(self, features: dict[str, float], guided: bool = True) -> list[int]:
        """The finishes a reuse with this evidence may run (``guided`` False: every step)."""
        return self.class_finishes(evidence_class(features)) if guided else [0]

    def save(self, path: str | Path) -> None:
        fields = {k: v for k, v in asdict(self).items() if k != "rejected"}
        Path(path).write_text(json.dumps({"format_version": FORMAT_VERSION, **fields}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "RiskModel":
        """A calibration file, every field checked (risk_model_check): ValueError (a
        CalibrationRejected for a wrong field) naming the file and what is wrong."""
        try:
            data = json.loads(Path(path).read_text())  # NaN/Infinity parse: the check names their field
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"risk model {path} is unreadable ({e!r}); re-run calibration "
                             "or delete the file to use the uncalibrated prior") from e
        data = check_calibration(data, path, FEATURES, EVIDENCE, EVIDENCE_CLASSES)
        known = {f.name for f in dataclass_fields(cls)} - {"rejected"}
        if set(data) - known:
            raise CalibrationRejected(f"calibration file {path}: fields {sorted(set(data) - known)} "
                                      "are unknown to this version; re-run calibration")
        return cls(**data)

    @classmethod
    def fit(cls, rows: list[dict[str, float]], labels: list[int], region_threshold: float,
            iters: int = 3000, lr: float = 0.5, l2: float = 1e-3,
            form: str = "linear") -> "RiskModel":
        """Logistic regression on (evidence, depth → exceeded tolerance?).

        ``form="linear"``: the five raw features, with an L2 penalty on the raw weights. The
        penalty weighs most on the small-range evidence features, so the fit leans on depth
        and stays conservative: on the tiny world its false-accept rate held within α on
        workloads it was not fitted on. ``form="interaction"``: adds the depth × evidence
        terms on log-scaled evidence, standardised columns, weights kept ≥ 0 (monotone
        risk). It reuses much deeper, but on the tiny world its false-accept rate exceeded α
        on the serve workload (README, Results), so it is opt-in.
        """
        if form not in RISK_FORMS:
            raise ValueError(f"unknown risk model form {form!r} (one of {', '.join(RISK_FORMS)})")
        # ComfyUI runs nodes under inference mode; the fit needs gradients
        with torch.inference_mode(False), torch.enable_grad():
            if form == "linear":
                return cls._fit_linear(rows, labels, region_threshold, iters, lr, l2)
            free = SIGNED_FREE if form == "signed" else ()
            return cls._fit_interaction(rows, labels, region_threshold, iters, lr, l2, free)

    @classmethod
    def _fit_interaction(cls, rows, labels, region_threshold, iters, lr, l2,
                         free: tuple[str, ...] = ()) -> "RiskModel":
        scale = INTERACTION_EVIDENCE_SCALE
        rows = [cls(weights={}, evidence_scale=scale).scaled(r) for r in rows]
        cols = [[r[k] for k in FEATURES] + [r["depth_fraction"] * r[k] for k in EVIDENCE]
                for r in rows]
        x = torch.tensor(cols, dtype=torch.float64)
        y = torch.tensor(labels, dtype=torch.float64)
        mean = x.mean(0)
        std = x.std(0).clamp_min(1e-9) if len(rows) > 1 else torch.ones_like(mean)
        # a column's weight stays ≥ 0 unless its evidence is free (main and depth terms alike)
        monotone = torch.tensor([k not in free for k in (*FEATURES, *EVIDENCE)])
        w, b = _logistic((x - mean) / std, y, l2, iters, lr, nonnegative=monotone)
        w = w / std  # back to the raw feature scale the gate uses
        bias = float(b - (w * mean).sum())
        n = len(FEATURES)
        return cls(weights={k: float(v) for k, v in zip(FEATURES, w[:n])},
                   depth_weights={k: float(v) for k, v in zip(EVIDENCE, w[n:])},
                   bias=bias, region_threshold=region_threshold, evidence_scale=scale,
                   calibrated=True, source=f"fitted on {len(rows)} measured reuses")

    @classmethod
    def _fit_linear(cls, rows, labels, region_threshold, iters, lr, l2) -> "RiskModel":
        x = torch.tensor([[r[k] for k in FEATURES] for r in rows], dtype=torch.float64)
        y = torch.tensor(labels, dtype=torch.float64)
        w, b = _logistic(x, y, l2, iters, lr, nonnegative=False)
        return cls(weights={k: float(v) for k, v in zip(FEATURES, w)},
                   bias=b, region_threshold=region_threshold,
                   calibrated=True, source=f"fitted on {len(rows)} measured reuses")


def _logistic(x: torch.Tensor, y: torch.Tensor, l2: float, iters: int, lr: float,
              nonnegative: bool | torch.Tensor) -> tuple[torch.Tensor, float]:
    """L2-penalised logistic regression by LBFGS: (weights, bias). ``nonnegative`` (for all
    columns, or a boolean mask per column) keeps those weights ≥ 0 through a softplus (with a
    strong-Wolfe line search, which that needs)."""
    dtype = torch.float64
    mask = torch.as_tensor(nonnegative, dtype=torch.bool).expand(x.shape[1])
    raw = torch.where(mask, torch.tensor(-2.0, dtype=dtype),
                      torch.tensor(0.0, dtype=dtype)).requires_grad_(True)
    weights = lambda: torch.where(mask, torch.nn.functional.softplus(raw), raw)  # noqa: E731
    b = torch.zeros((), dtype=dtype, requires_grad=True)
    opt = torch.optim.LBFGS([raw, b], lr=lr, max_iter=iters,
                            line_search_fn="strong_wolfe" if bool(mask.any()) else None)

    def closure():
        opt.zero_grad()
        w = weights()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y)
        loss = loss + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return weights().detach().clone(), float(b.detach())


def risk_model_for(cache_folder: str | Path, model_fingerprint: str,
                   probe_fraction: float = DEFAULT_PROBE_FRACTION, steps: int = 0) -> RiskModel:
    """The calibrated risk model for this model and probe if one was fitted, else the
    default prior. A file is found by the model's fingerprint and the probe only: another
    model's, or one measured with another probe, is never used. ``steps``: the request's N;
    a calibration measured at that N is preferred to the one carried over by depth shares."""
    path = calibration_in_use(cache_folder, model_fingerprint, probe_fraction, steps)
    if not path.is_file():
        return RiskModel(probe_fraction=float(probe_fraction))
    model = RiskModel.load(path)
    if not same_probe(model.probe_fraction, probe_fraction):
        raise ValueError(f"risk model {path} was measured with probe_fraction "
                         f"{model.probe_fraction:g}, not {float(probe_fraction):g}: its name and "
                         "content disagree; re-run calibration or delete the file")
    if path != calibration_file(cache_folder, model_fingerprint, probe_fraction) \
            and model.measured_steps != steps:
        raise ValueError(f"risk model {path} was measured at {model.measured_steps} steps, not "
                         f"{steps}: its name and content disagree; re-run calibration or delete the file")
    return model


def gate_model_for(cache_folder: str | Path, model_fingerprint: str,
                   probe_fraction: float = DEFAULT_PROBE_FRACTION, steps: int = 0) -> RiskModel:
    """What the gate uses: ``risk_model_for``, or — when that file is unusable (damaged,
    a field of the wrong type or range, name and content disagreeing, unreadable) — the
    uncalibrated prior carrying why in ``rejected``. A calibration file is input: it may
    make the gate fall back, never fail a request."""
    try:
        return risk_model_for(cache_folder, model_fingerprint, probe_fraction, steps)
    except (ValueError, OSError) as e:
        log.warning("Carnator: %s", e)
        return RiskModel(probe_fraction=float(probe_fraction), rejected=str(e))


def calibration_in_use(cache_folder: str | Path, model_fingerprint: str,
                       probe_fraction: float = DEFAULT_PROBE_FRACTION, steps: int = 0) -> Path:
    """The file risk_model_for reads at ``steps``: the one measured at that N, else the general one."""
    at_n = calibration_file(cache_folder, model_fingerprint, probe_fraction, steps) if steps else None
    return at_n if at_n is not None and at_n.is_file() \
        else calibration_file(cache_folder, model_fingerprint, probe_fraction)


@dataclass
class GateSettings:
    risk_budget: float = 0.05      # α: the accepted share of reuses beyond tolerance
    min_depth: float = 0.2         # k* bounds as fractions of the step count
    max_depth: float = 0.8         # deepest snapshot; how deep each evidence class may go is certified
    max_region_fraction: float = 0.5  # beyond this the request is mostly new: reject
    guided_finish: bool = True     # may choose a guided finish where the calibration certified one
    # The least share of the steps a reuse must save. Only requests computed in full are reuse
    # sources (cache.lookup: chained reuse broke the budget), so a hit that saves little
    # (an edit resumed at k* = 10 of 20 saves 30%) also costs every later request for the
    # same scene its same-scene reuse (70% saved). Below this share the request runs in
    # full and becomes a source. 0: reuse whenever the budget allows.
    min_saving: float = 0.0
    # Compute in full a request whose own scene was asked before but served by reuse of
    # another (so no source), when a source of that scene would be reused cheaper than the
    # reuse it has now (pipeline.recurring_scene): the scene's next requests then reuse it
    # same-scene. Unlike min_saving it spends a full computation only on a scene seen twice,
    # so it is on by default: on the tiny world's serve it took the whole workload from 1.46×
    # to 1.71× fewer steps, and cost editing sessions (iterate) 1% (docs/results.md).
    recurring_sources: bool = True


@dataclass
class Plan:
    """The gate's decision for one request."""

    accept: bool
    entry_id: str | None = None
    reuse_step: int | None = None          # k*
    region_tiles: torch.Tensor | None = None  # bool (tiles,) — M
    risk: float | None = None
    similarity: float | None = None
    features: dict[str, float] | None = None
    reason: str = ""
    finish_calls: int = 0                  # 0: every step after k*; else a guided finish's calls
    finish_region: bool = False            # the guided finish computes M's tokens between its calls

    @property
    def region_fraction(self) -> float:
        if self.region_tiles is None:
            return 0.0
        return float(self.region_tiles.float().mean())


def evidence(new: EarlySignature, old: EarlySignature, similarity: float,
             region_threshold: float) -> tuple[dict[str, float], torch.Tensor]:
    """Features for the risk model, and the region M, for one candidate."""
    dev = tile_deviation(new, old)
    region = dev > region_threshold
    outside = dev[~region] if (~region).any() else dev.new_zeros(1)
    feats = {"outside_mean": float(outside.mean()), "outside_max": float(outside.max()),
             "region_fraction": float(region.float().mean()),
             "depth_fraction": 0.0, "similarity_gap": max(0.0, 1.0 - similarity)}
    return feats, region


def reuse_region(features: dict[str, float], region: torch.Tensor, grid: tuple[int, int, int],
                 margin: int) -> torch.Tensor:
    """The region a reuse computes itself: the probe's M, widened by ``margin`` tiles where the
    evidence is *other* (an edit). The probe sees an edit early and blurred, so its M misses the
    edge of what changes, and with M on its own trajectory that edge is what fails deep reuses:
    one tile more in space and time cut the reuses beyond tolerance at k = 16 of 20 from 27 to
    13 of 98 edit pairs for +0.6 steps (bench/studies/region_dilation_study.py). Same-scene evidence
    keeps its few tiles as they are. The evidence features still describe the probe's M."""
    if margin <= 0 or evidence_class(features) != "other" or not bool(region.any()):
        return region
    return widen_tiles(region, grid, margin)


def region_reason(fraction: float, limit: float) -> str:
    """Why a candidate whose region M is too large is not reused."""
    if limit <= 0:
        return (f"{fraction:.0%} of tiles differ and max_region is 0 (reuse only when no tile "
                "differs); raise max_region to let the gate recompute a region")
    return (f"{fraction:.0%} of tiles differ, more than max_region ({limit:.0%}) allows"
            + (": mostly a new video" if fraction > 0.5 else ""))


def depth_reason(settings: GateSettings, lo: int, hi: int, probe_steps: int, steps: int) -> str:
    """Why no depth k* could be chosen, in the words of the settings a person set."""
    if settings.min_depth > settings.max_depth:
        return (f"min_depth ({settings.min_depth:.2f}) is above max_depth ({settings.max_depth:.2f}): "
                "the bounds are swapped, so no depth can be reused; set min_depth ≤ max_depth")
    if lo > hi:
        return (f"max_depth ({settings.max_depth:.2f}) ends at step {hi} of {steps}, before the "
                f"probe's {probe_steps} steps: no depth is left to reuse; raise max_depth")
    return (f"the matched entry has no stored snapshot between steps {lo} and {hi} "
            "(it was stored with other depth bounds)")


def tile_share(region: torch.Tensor) -> float:
    """Share of the tiles a region covers: ``decide``'s stand-in for its token share where the
    caller cannot map tiles to the model's tokens."""
    return float(region.float().mean()) if region.numel() else 0.0


def decide(new: EarlySignature, candidates: list[tuple[str, EarlySignature, float, list[int]]],
           steps: int, probe_steps: int, model: RiskModel,
           settings: GateSettings, fill_calls: int = 0, fill_on_m: bool = False,
           region_share=tile_share) -> tuple[Plan, list[Plan]]:
    """Pick the best acceptable candidate and depth; also return every candidate's verdict.

    ``candidates``: (entry id, its signature at the probe step, similarity, snapshot steps,
    optionally whether it stored the x̂0 a guided finish needs — assumed when absent).
    The candidate whose acceptable finish computes least wins; ties go to lower risk.
    ``fill_calls``: model steps a hit spends filling region M (ReuseSettings.region_fill_calls),
    or ``fill_on_m`` M's own trajectory on its tokens (RiskModel.region_fill_on_m), counted in
    the saving ``settings.min_saving`` asks for. ``region_share``: the share of the model's
    tokens a region of tiles covers (the pipeline maps tiles to its run's tokens, as a region
    finish computes them); it places other evidence in its certified cell (``share_cell``).
    """
    lo = max(probe_steps, math.ceil(settings.min_depth * steps))
    hi = math.floor(settings.max_depth * steps)
    verdicts: list[Plan] = []
    for entry_id, old, sim, snapshot_steps, *stored_x0 in candidates:
        feats, region = evidence(new, old, sim, model.region_threshold)
        region = reuse_region(feats, region, new.grid, model.region_margin)
        feats["reuse_share"] = region_share(region) if bool(region.any()) else 0.0
        base = dict(entry_id=entry_id, region_tiles=region, similarity=sim)
        if feats["region_fraction"] > settings.max_region_fraction:
            verdicts.append(Plan(False, features=feats, reason=region_reason(
                feats["region_fraction"], settings.max_region_fraction), **base))
            continue
        depths = sorted((k for k in snapshot_steps if lo <= k <= hi), reverse=True)
        if not depths:
            verdicts.append(Plan(False, features=feats, reason=depth_reason(
                settings, lo, hi, probe_steps, steps), **base))
            continue
        guided = settings.guided_finish and (stored_x0[0] if stored_x0 else True)
        verdicts.append(_cheapest_acceptable(feats, depths, steps, model, settings.risk_budget, guided, base))
    accepted = [p for p in verdicts if p.accept]
    if not accepted:
        if not verdicts:
            return Plan(False, reason="no candidates"), verdicts
        return verdicts[0], verdicts  # the best-ranked candidate's verdict explains the miss
    accepted.sort(key=lambda p: (_cost(p, steps), p.risk))
    best = accepted[0]
    saving = hit_saving(best, steps, probe_steps, fill_calls, fill_on_m)
    if saving < settings.min_saving:
        return Plan(False, entry_id=best.entry_id, risk=best.risk, similarity=best.similarity,
                    features=best.features, region_tiles=best.region_tiles, reason=(
                        f"the best reuse (k*={best.reuse_step}) saves {saving:.0%} of the steps, "
                        f"less than min_saving {settings.min_saving:.0%}: computed in full, so "
                        "this request becomes a reuse source for later ones")), verdicts
    return best, verdicts


def hit_saving(plan: Plan, steps: int, probe_steps: int, fill_calls: int = 0,
               fill_on_m: bool = False) -> float:
    """Share of the steps an accepted plan does not compute: probe, M's fill (when M is not
    empty) and the finish are computed; region calls count at M's token share (its share of
    the tiles stands in for it here)."""
    fill = 0.0
    if plan.region_fraction > 0:
        fill = fill_steps(fill_calls, plan.reuse_step, probe_steps)
        if fill_on_m and plan.reuse_step > probe_steps + FILL_SEGMENT_STEPS:
            # region_compute's fill in (at most) two segments: a full call each, the rest on
            # M's tokens
            fill = 2 * (1 + (FILL_SEGMENT_STEPS - 1) * plan.region_fraction)
    return 1.0 - (probe_steps + fill + _cost(plan, steps)) / steps


def fill_steps(calls: int, k: int, probe_steps: int) -> int:
    """Model steps the fill of region M computes from the probe to k (pipeline.fill_region)."""
    return min(calls, k - probe_steps) if calls > 0 and k > probe_steps else 0


def _cheapest_acceptable(feats: dict[str, float], depths: list[int], steps: int,
                         model: RiskModel, alpha: float, guided: bool, base: dict) -> Plan:
    """Of the finishes this evidence may run, the one that computes least: each at the
    deepest depth (``depths`` deepest first) the risk model accepts for it under α."""
    plans = [_deepest_acceptable(feats, depths, steps, model, alpha, base, calls)
             for calls in model.finish_options(feats, guided)]
    accepted = [p for p in plans if p.accept]
    if not accepted:
        return plans[0]  # the every-step finish's verdict explains the miss
    return min(accepted, key=lambda p: (_cost(p, steps), p.finish_calls))


def _cost(plan: Plan, steps: int) -> float:
    return finish_cost(plan.reuse_step, steps, plan.finish_calls,
                       plan.region_fraction if plan.finish_region else 0.0)


def _deepest_acceptable(feats: dict[str, float], depths: list[int], steps: int,
                        model: RiskModel, alpha: float, base: dict, finish_calls: int = 0) -> Plan:
    """The deepest depth (``depths`` deepest first) the risk model accepts under α for
    this finish."""
    klass = evidence_class(feats)
    cell = model.cell(feats)
    key = option_key(cell, finish_calls)
    what = share_bin_text(cell, model.region_share_bounds)
    certified = model.threshold_for(alpha, key) if model.thresholds else None
    if model.thresholds and certified is None:
        budgets = [float(a) for a in model.thresholds.get(key, {})]
        if budgets:
            why = f"the strictest certified budget is {min(budgets):.1%}: raise the budget or re-calibrate"
        elif cell != klass:  # a share bin the calibration's pairs did not cover well enough
            why = ("its calibration certified no budget there (too few measured reuses like it): "
                   "not extrapolated; calibrate with pairs whose edits cover that much of the frame")
        else:
            why = "none is: raise the budget or re-calibrate"
        return Plan(False, features=feats, reason=(
            f"no depth is certified at risk budget {alpha:.1%} for {what} on this model "
            f"({why})"), **base)
    how = (f"{what}, certified at budget {certified[0]:.1%} with "
           f"{model.confidence:.0%} confidence" if certified else f"≤ budget {alpha:.1%}")
    region = bool(finish_calls and model.finish_region.get(klass))
    tiles = base.get("region_tiles")
    if region and tiles is not None and bool(tiles.all()):  # widened M is the whole frame
        return Plan(False, features=feats, reason=(
            "region M covers the whole frame: a region finish would compute every token"), **base)
    for k in depths:
        f = {**feats, "depth_fraction": k / steps}
        if (finish_allows(k, steps, finish_calls, region, model.measured_steps)
                and model.accepts(f, alpha, finish_calls)):
            r = model.risk(f)
            calls = finish_calls_at(k, steps, finish_calls, region)
            finish = (f", guided finish of {calls} calls" + (" with region M computed between them"
                                                            if region else "")) if calls else ""
            return Plan(True, reuse_step=k, risk=r, features=f, finish_calls=calls,
                        finish_region=region, reason=f"risk {r:.1%} at k*={k} ({how}{finish})", **base)
    f = {**feats, "depth_fraction": depths[-1] / steps}
    r = model.risk(f)
    return Plan(False, risk=r, features=f, reason=(
        f"predicted risk {r:.1%} at the shallowest depth {depths[-1]} is not within the "
        f"budget {alpha:.1%}"), **base)
