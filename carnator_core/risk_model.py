"""The risk model: P(deviation beyond tolerance | evidence, depth) as a logistic function whose
thresholds a calibration certifies per class and cell, and where a model's calibration file
lives (by fingerprint, probe and N). The default weights are an uncalibrated prior."""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field, asdict, fields as dataclass_fields
from pathlib import Path

import torch

from .risk_model_check import FORMAT_VERSION, CalibrationRejected, check_calibration

from .evidence import (EVIDENCE, EVIDENCE_CLASSES, FEATURES, NEAR_SCENE_CELL, evidence_class, near_scene,
                       option_key, share_cell)

log = logging.getLogger("carnator")

INTERACTION_EVIDENCE_SCALE = 0.01  # s(e) = log(1 + e/0.01): 0.4% of tiles and 15% far apart
# The evidence whose weights the signed form leaves free in sign. When M is filled on its own
# tokens (pipeline.fill_region), what M covers the request computes itself: the risk sits in
# what the probe did not put in M, so a larger M is *safer* (calibration: beyond tolerance at
# k = 12 of 20, 19% of other-evidence pairs with M under 5% of the tiles, 4% with M over 20%),
# and a monotone fit pins these weights at 0. Disagreement outside M and depth stay monotone.
SIGNED_FREE = ("region_fraction", "similarity_gap")
RISK_FORMS = ("linear", "interaction", "signed")


# ReuseSettings' default: a one-step probe at N = 20. Evidence read that early certified the
# deepest reuse every budget held with on the tiny world (docs/results.md).
DEFAULT_PROBE_FRACTION = 0.05
# The probe of a calibration file whose name gives none (``<fingerprint>.json``) and of a file
# whose content gives none: the files written before the probe was recorded were measured so.
UNNAMED_PROBE_FRACTION = 0.1


def same_probe(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) < 1e-6


def calibration_file(cache_folder: str | Path, model_fingerprint: str,
                     probe_fraction: float = UNNAMED_PROBE_FRACTION, steps: int = 0) -> Path:
    """Where a model's calibration for this probe lives: ``<fingerprint>.json`` for
    UNNAMED_PROBE_FRACTION, ``<fingerprint>.probe<share>.json`` for another — the one used at any N.
    ``steps``: the name of one measured at that N beside it (``….n<steps>.json``), which the
    gate prefers at that N (calibration.save writes it when the first holds another N)."""
    name = model_fingerprint if same_probe(probe_fraction, UNNAMED_PROBE_FRACTION) \
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
        probe = float(m.group(2)) if m.group(2) else UNNAMED_PROBE_FRACTION
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
    # before this field were all measured with UNNAMED_PROBE_FRACTION, and a model that
    # names no probe is for that one, as its file name is.
    probe_fraction: float = UNNAMED_PROBE_FRACTION
    # The steps N the reuses were measured with (0: not recorded). Depths transfer to another
    # N by their share of it; so does the span a region finish may cover (finish_allows).
    measured_steps: int = 0
    # The latent sizes (frames, height, width, in latent units) the reuses were measured at;
    # empty: not recorded. A calibration at a smaller size costs less by its share of the
    # tokens; the status says when a request is of another size, where α is not certified.
    measured_latents: list[list[int]] = field(default_factory=list)
    # Per cell, thresholds the online certificate may walk besides the certified ones (the
    # cheap procedure's transferred ranking offers them where too few labels certified any):
    # the gate never runs at one until audits certify it (audit.ladder, online.certificates).
    ladders: dict[str, list[float]] = field(default_factory=dict)
    # Upper bounds of the bins of the token share a reuse with other evidence computes itself
    # (``REGION_SHARE_BOUNDS``): each bin's thresholds are certified apart (``share_cell``).
    # Empty: one class for all other evidence (files written before the bins).
    region_share_bounds: list[float] = field(default_factory=list)
    # Whether near-scene evidence (``evidence.near_scene``) is certified as a cell of its own,
    # ``NEAR_SCENE_CELL``, instead of in the bin of its token share. False: files before it.
    near_scene_cell: bool = False
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
        token share the reuse computes itself (``features["reuse_share"]``), or near-scene
        evidence apart where the calibration certified it so."""
        if self.near_scene_cell and near_scene(features):
            return NEAR_SCENE_CELL
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
                   probe_fraction: float = UNNAMED_PROBE_FRACTION, steps: int = 0) -> RiskModel:
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
                   probe_fraction: float = UNNAMED_PROBE_FRACTION, steps: int = 0) -> RiskModel:
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
                       probe_fraction: float = UNNAMED_PROBE_FRACTION, steps: int = 0) -> Path:
    """The file risk_model_for reads at ``steps``: the one measured at that N, else the general one."""
    at_n = calibration_file(cache_folder, model_fingerprint, probe_fraction, steps) if steps else None
    return at_n if at_n is not None and at_n.is_file() \
        else calibration_file(cache_folder, model_fingerprint, probe_fraction)
