"""What a reward misses: diversity across seeds, distance to real data, and whether two judges agree.

All metrics group the samples by prompt (the evaluation draws ``eval_seeds_per_prompt`` seeds of each
prompt) and are family-agnostic; a family adds real data and a feature space through :class:`FeatureSpace`
(the digits miniature: ``digits_gold2``, the second judge's hidden layer).

- **Pixel diversity** (``diversity_pixel``): per prompt, the mean over pairs of samples of the RMS pixel
  distance ``‖a − b‖₂ / √D`` (images in [0, 1], ``D`` values per image, a video's frames included), then the
  mean over prompts. 0 for identical samples; resolution-free.
- **Near-duplicate fraction** (``near_duplicate_frac``): the share of those pairs closer than
  :data:`NEAR_DUPLICATE_RMS` = 0.03 RMS (about 8 of 255 grey levels): the pair looks identical. On the digits
  miniature 0.009 % of the pairs of distinct real digits of one class (same colour) come closer (the closest
  is at 0.017, the mean at 0.12); the base generator's (the one shipped before 2026-12-05) closest pair among 8 seeds of each of its 60 prompts
  is at 0.084 (mean 0.16).
- **Feature diversity** (``diversity_feature``): the same mean pairwise L2 distance in the feature space.
- **Fidelity headline** (:func:`fidelity_headline`): a metric that counts a sample only when it is right and real
  (digits: ``digits_fidelity``), taken at the evaluation where it is highest while the diversity stays at least
  :data:`DIVERSITY_FLOOR` × the base's, so a run that collapses onto a few hacked samples gains nothing there.
- **Fréchet distance** (``frechet``): per prompt, the squared Fréchet distance between Gaussians fitted to
  the features of the prompt's samples and of real images of the prompt (``FeatureSpace.reference_features``),
  :func:`frechet_distance`, averaged over prompts (an FID for the miniature, conditioned on the prompt). With
  a handful of seeds per prompt the estimate is biased upwards (a rank-deficient covariance), the same bias
  before and after training but not across sample sizes: compare values at equal seeds per prompt, and
  against the floor of as many real samples (``benchmarks/learning/collapse.py``; digits, 8 seeds per prompt: real
  digits 32.7, the base generator shipped before 2026-12-05 94.7; with the trainer's 4 evaluation seeds the base gives 120.6).
  ``frechet_pooled``: one Fréchet distance between all samples and the mixture of their prompts' real sets
  (each prompt weighted by its number of samples), less biased, less sensitive to collapse within a prompt
  (digits, 8 seeds: real 1.0, base 34.2).

:func:`judge_disagreement` tells whether two judges' changes over training differ beyond the evaluation
noise (paired over the fixed evaluation seeds); :func:`relative_to_base` puts diversities relative to the
base model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from diffrl.sampling.evaluation import paired_change, read_jsonl
from rewards.base import build_reward

NEAR_DUPLICATE_RMS = 0.03
"""RMS pixel distance (images in [0, 1]) under which two samples of a prompt count as near-duplicates."""

DIVERSITY_KEYS = ("diversity_pixel", "diversity_feature")
DISTRIBUTION_KEYS = ("diversity_pixel", "diversity_feature", "near_duplicate_frac", "frechet", "frechet_pooled")
"""Names of the metrics :func:`distribution_metrics` may return (without the ``eval/`` prefix)."""


@runtime_checkable
class FeatureSpace(Protocol):
    """A feature map and real reference data, e.g. a classifier's hidden layer (the digits: ``digits_gold2``)."""

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images ``[N, 3, H, W]`` → float features ``[N, D]``."""

    def reference_features(self, prompt: str) -> torch.Tensor:
        """Features ``[M, D]`` of real images that fit ``prompt`` (M ≥ 2)."""


def build_feature_space(name: str, options: dict | None = None) -> FeatureSpace:
    """The reward registered as ``name`` (built with ``options``), checked to provide :class:`FeatureSpace`.

    Raises:
        TypeError: naming the reward when it has no ``features`` / ``reference_features``.
    """
    return feature_space_of(build_reward(name, **(options or {})), name)


def feature_space_of(space: Any, name: str) -> FeatureSpace:
    """The built reward ``space`` (registered as ``name``), checked to provide :class:`FeatureSpace`.

    Raises:
        TypeError: naming the reward when it has no ``features`` / ``reference_features``.
    """
    if not isinstance(space, FeatureSpace):
        raise TypeError(
            f"reward {name!r} ({type(space).__name__}) is no feature space: it needs features(images) and "
            "reference_features(prompt) (diffrl.sampling.distribution.FeatureSpace); set reward.feature_space to such a "
            "reward (digits: digits_gold2) or to null"
        )
    return space


# -- pure pieces ----------------------------------------------------------------------------------
def flat_pixels(images: torch.Tensor) -> torch.Tensor:
    """Images (uint8 in [0, 255] or float in [0, 1]; any shape ``[N, …]``) → float64 ``[N, D]`` in [0, 1]."""
    x = images.detach().cpu().flatten(1).double()
    return x / 255.0 if images.dtype == torch.uint8 else x


def group_by_prompt(prompts: list[str]) -> dict[str, list[int]]:
    """``{prompt: [indices]}`` in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    return groups


def pairwise_distances(x: torch.Tensor) -> torch.Tensor:
    """L2 distances of all ``n (n − 1) / 2`` unordered pairs of rows of ``x [n, D]`` (float64)."""
    x = x.double()
    if x.shape[0] < 2:
        return x.new_zeros(0)
    i, j = torch.triu_indices(x.shape[0], x.shape[0], offset=1)
    return (x[i] - x[j]).norm(dim=1)


def gaussian_fit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[D]`` and unbiased covariance ``[D, D]`` (divisor ``n − 1``) of the rows of ``x [n, D]``, float64."""
    x = x.double()
    if x.shape[0] < 2:
        raise ValueError(f"a covariance needs at least 2 samples, got {x.shape[0]}")
    mu = x.mean(0)
    centred = x - mu
    return mu, centred.T @ centred / (x.shape[0] - 1)


def _psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric positive semi-definite matrix (eigenvalues clipped at 0)."""
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T


def frechet_distance(mu1: torch.Tensor, cov1: torch.Tensor, mu2: torch.Tensor, cov2: torch.Tensor) -> float:
    """Squared Fréchet (2-Wasserstein) distance between ``N(mu1, cov1)`` and ``N(mu2, cov2)``:

    ``d² = ‖μ₁ − μ₂‖² + Tr(Σ₁ + Σ₂ − 2 (Σ₁^{1/2} Σ₂ Σ₁^{1/2})^{1/2})`` (Dowson & Landau 1982; the FID of
    Heusel et al. 2017 is this in Inception features). ``Tr((Σ₁Σ₂)^{1/2})`` equals the trace of the
    symmetric form used here, whose square roots are eigen-decompositions in float64: no complex parts, and
    rank-deficient covariances (fewer samples than dimensions) are fine.
    """
    mu1, mu2, cov1, cov2 = (t.double() for t in (mu1, mu2, cov1, cov2))
    root1 = _psd_sqrt(cov1)
    cross = _psd_sqrt(root1 @ cov2 @ root1)
    return float((mu1 - mu2).square().sum() + torch.trace(cov1) + torch.trace(cov2) - 2 * torch.trace(cross))


def frechet_between(a: torch.Tensor, b: torch.Tensor) -> float:
    """:func:`frechet_distance` between Gaussians fitted (:func:`gaussian_fit`) to samples ``a [n, D]`` and ``b [m, D]``."""
    return frechet_distance(*gaussian_fit(a), *gaussian_fit(b))


def mixture_fit(parts: list[tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance of a mixture of the empirical Gaussians of ``(samples [n_k, D], weight_k)``."""
    total = sum(w for _, w in parts)
    fits = [(gaussian_fit(x), w / total) for x, w in parts]
    mu = sum(w * m for (m, _), w in fits)
    cov = sum(w * (c + torch.outer(m - mu, m - mu)) for (m, c), w in fits)
    return mu, cov


def near_duplicate_fraction(distances_rms: torch.Tensor, threshold: float = NEAR_DUPLICATE_RMS) -> float:
    """Share of pair distances (RMS pixel units) below ``threshold``; NaN when there are no pairs."""
    return float((distances_rms < threshold).double().mean()) if distances_rms.numel() else float("nan")


# -- per prompt and per evaluation ------------------------------------------------------------------
def per_prompt_metrics(images: torch.Tensor, prompts: list[str], feature_space: FeatureSpace | None = None, *,
                       threshold: float = NEAR_DUPLICATE_RMS) -> list[dict]:
    """One row per prompt with ≥ 2 samples: ``prompt``, ``n``, ``diversity_pixel``, ``near_duplicate_frac``
    and, with a feature space, ``diversity_feature`` and ``frechet`` (see the module docstring).

    Args:
        images: ``[N, …]`` uint8 (or float in [0, 1]) samples, any order.
        prompts: ``N`` prompts; samples with equal prompts form a group (different seeds).
    """
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images need {images.shape[0]} prompts, got {len(prompts)}")
    feats = feature_space.features(images).double() if feature_space is not None else None
    return _prompt_rows(images, prompts, feats, feature_space, threshold)


def _prompt_rows(images, prompts, feats, feature_space, threshold) -> list[dict]:
    pixels = flat_pixels(images)
    rows = []
    for prompt, idx in group_by_prompt(prompts).items():
        if len(idx) < 2:
            continue
        rms = pairwise_distances(pixels[idx]) / pixels.shape[1] ** 0.5
        row = {"prompt": prompt, "n": len(idx), "diversity_pixel": float(rms.mean()), "near_duplicate_frac": near_duplicate_fraction(rms, threshold)}
        if feats is not None:
            row["diversity_feature"] = float(pairwise_distances(feats[idx]).mean())
            row["frechet"] = frechet_between(feats[idx], feature_space.reference_features(prompt))
        rows.append(row)
    return rows


def distribution_metrics(images: torch.Tensor, prompts: list[str], feature_space: FeatureSpace | None = None, *,
                         threshold: float = NEAR_DUPLICATE_RMS, prefix: str = "eval/") -> dict[str, float]:
    """The evaluation's distribution metrics: ``{prefix + name: value}`` with names ``diversity_pixel``,
    ``near_duplicate_frac`` and, with ``feature_space``, ``diversity_feature``, ``frechet`` (means over
    prompts) and ``frechet_pooled``; empty when no prompt has two samples (one seed per prompt).
    """
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images need {images.shape[0]} prompts, got {len(prompts)}")
    feats = feature_space.features(images).double() if feature_space is not None else None
    rows = _prompt_rows(images, prompts, feats, feature_space, threshold)
    if not rows:
        return {}
    keys = [k for k in rows[0] if k not in ("prompt", "n")]
    out = {prefix + k: sum(r[k] for r in rows) / len(rows) for k in keys}
    if feature_space is not None:
        groups = group_by_prompt(prompts)
        real = mixture_fit([(feature_space.reference_features(p), len(idx)) for p, idx in groups.items()])
        out[prefix + "frechet_pooled"] = frechet_distance(*gaussian_fit(feats), *real)
    return out


# -- over training ------------------------------------------------------------------------------------
def relative_to_base(before: dict, after: dict, prefix: str = "eval/") -> dict[str, float]:
    """``{"<name>_vs_base": after / before}`` for each diversity in both evaluations (1.0: as diverse as the base)."""
    return {f"{k}_vs_base": after[prefix + k] / before[prefix + k] for k in DIVERSITY_KEYS
            if prefix + k in before and prefix + k in after and before[prefix + k] > 0}


def judge_disagreement(before_rows: list[dict], after_rows: list[dict], gold: str, judge: str, *, z: float = 2.0) -> dict:
    """Do ``gold`` and ``judge`` see the same change from one evaluation to another?

    Per evaluation sample ``i`` (the same prompt and seed before and after), ``dᵢ = Δgoldᵢ − Δjudgeᵢ``; the
    judges disagree when ``|mean d| > z · stderr(d)`` (paired t beyond ``z``). Also reported: each judge's
    mean before and after, and ``agreement_before`` / ``agreement_after``, the share of samples on which the
    two judges give the same score.

    Args:
        before_rows, after_rows: ``images/eval_step_N.jsonl`` records (``prompt``, ``seed``, one key per metric).
    """
    missing = [k for k in (gold, judge) if any(k not in r for r in (*before_rows, *after_rows))]
    if missing:
        raise KeyError(f"judge_disagreement: the evaluation rows lack {missing}; evaluate with both judges")
    diff = lambda rows: [{**r, "gold_minus_judge": r[gold] - r[judge]} for r in rows]
    change = paired_change(diff(before_rows), diff(after_rows), ["gold_minus_judge", gold, judge])
    d = change["gold_minus_judge"]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)
    agree = lambda rows: sum(r[gold] == r[judge] for r in rows) / len(rows)
    return {
        "gold": gold, "judge": judge, "n": d["n"],
        "gold_before": mean(before_rows, gold), "gold_after": mean(after_rows, gold),
        "judge_before": mean(before_rows, judge), "judge_after": mean(after_rows, judge),
        "gold_change": change[gold]["mean_change"], "judge_change": change[judge]["mean_change"],
        "difference": d["mean_change"], "stderr": d["stderr"], "t": d["t"],
        "agreement_before": agree(before_rows), "agreement_after": agree(after_rows),
        "disagree": bool(abs(d["mean_change"]) > z * d["stderr"]) if d["stderr"] == d["stderr"] else False,
    }


DIVERSITY_FLOOR = 0.70
"""An evaluation counts for the fidelity headline only while its diversity is at least this share of the base's."""


def fidelity_headline(evals: list[dict], metric: str, floor: float = DIVERSITY_FLOOR) -> dict:
    """The headline of a run under fidelity: ``metric`` (e.g. ``digits_fidelity``: right *and* real) at the evaluation
    where it is highest among those whose diversity stays ``≥ floor ×`` the base's.

    Args:
        evals: the run's evaluation records in step order (``metrics.jsonl`` rows of kind ``eval``: ``step``,
            ``eval/<name>``); the first is the base (step 0).
        metric: the eval metric's name (without ``eval/``).

    Returns:
        ``before`` (the base's value), ``best`` / ``step`` / ``gain`` (``None`` when no trained evaluation keeps the
        diversity: "none"), ``last`` / ``last_gain`` (the final evaluation, whatever its diversity), ``diversity_key``
        (feature diversity, else pixel diversity; ``None`` when the evaluations measured neither: no floor applies),
        ``diversity_floor`` (the value an evaluation must reach) and ``diversity_at_best``.

    Raises:
        KeyError: naming the metric when an evaluation lacks it.
    """
    key = f"eval/{metric}"
    if not evals or any(key not in e for e in evals):
        raise KeyError(f"fidelity headline: the evaluations lack {key}; evaluate with reward.fidelity={metric}")
    base, trained = evals[0], evals[1:]
    div = next((f"eval/{k}" for k in ("diversity_feature", "diversity_pixel") if all(f"eval/{k}" in e for e in evals)), None)
    bar = floor * base[div] if div else None
    kept = [e for e in trained if div is None or e[div] >= bar]
    best = max(kept, key=lambda e: e[key], default=None)  # the first of equal values: the earliest evaluation
    last = trained[-1] if trained else base
    return {
        "metric": metric, "before": base[key],
        "best": None if best is None else best[key], "step": None if best is None else best["step"],
        "gain": None if best is None else best[key] - base[key],
        "last": last[key], "last_gain": last[key] - base[key],
        "diversity_key": div, "diversity_floor": bar, "diversity_at_best": None if best is None or div is None else best[div],
    }


def collapse_summary(before: dict, after: dict, run_dir: str | Path, steps: int, gold: str | None, judges: list[str]) -> dict:
    """What a run's ``summary.json`` gains: :func:`relative_to_base` of the first and last evaluations and,
    with a gold metric, ``"judges": {judge: judge_disagreement(...)}`` between the per-sample scores of the
    evaluations at step 0 and ``steps`` (``images/eval_step_N.jsonl``; left out when either is missing)."""
    out: dict = relative_to_base(before, after)
    files = [Path(run_dir) / "images" / f"eval_step_{s:06d}.jsonl" for s in (0, steps)]
    others = [j for j in judges if j != gold]
    if gold and others and steps > 0 and all(f.is_file() for f in files):
        rows = [read_jsonl(f) for f in files]
        out["judges"] = {j: judge_disagreement(*rows, gold, j) for j in others}
    return out
