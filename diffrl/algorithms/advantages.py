"""Advantages from rewards, normalised within prompt groups (GRPO, Shao et al. 2024; Flow-GRPO).

    A_i = clip((r_i − mean_{g(i)}) / (std + eps), −clip_max, clip_max)

``std`` is the reward std of sample i's group (``std_mode="group"``, GRPO), the std of the whole
batch (``"global"``, Flow-GRPO's default, which keeps low-variance groups from being amplified), or 1
(``"none"``, Dr.GRPO). Stds are population stds by default (``ddof=0``, numpy's ``np.std``, as flow_grpo);
``ddof=1`` is ``torch.std``'s unbiased std, and a fractional ``ddof`` is the std of rewards repeated over
steps (verl-omni's ``torch.std`` of the ``[B, T]`` reward tensor is ``ddof = 1/T``).

Also: ``check_group_size`` (refuse groups of one sample), ``group_std_keep_mask`` (drop zero-variance groups),
``nonzero_advantage_keep_mask`` (flow_grpo's drop: every sample whose advantage is exactly 0),
``PerPromptStatTracker`` (DDPO's per-prompt running statistics) and ``aggregate_rewards`` (several weighted rewards).
"""

from __future__ import annotations

from collections import deque

import torch

from diffrl.config import AGGREGATION_MODES, STD_MODES


def group_advantages(
    rewards: torch.Tensor,
    group_id: torch.Tensor,
    *,
    std_mode: str = "global",
    eps: float = 1e-4,
    clip_max: float = 5.0,
    ddof: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Group-normalised advantages.

    Args:
        rewards: ``[B]`` rewards.
        group_id: ``[B]`` integer group of each sample (samples of one prompt share a group).
        std_mode: ``"group"`` | ``"global"`` | ``"none"``.
        eps: added to the std.
        clip_max: advantages are clipped to ``[−clip_max, clip_max]``.
        ddof: the std is ``sqrt(Σ (r − mean)² / (N − ddof))`` over the N rewards it spans (0: population std).
        dtype: precision of the computation and the result (float64 in the parity tests).

    Returns:
        ``[B]`` advantages of ``dtype``.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown advantage std_mode {std_mode!r}; choose one of {STD_MODES}")
    if not 0 <= ddof < 2:
        raise ValueError(f"advantage std ddof must be in [0, 2), got {ddof}")
    r = rewards.to(dtype)
    _, inverse = torch.unique(group_id, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    counts = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    means = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, r) / counts
    centred = r - means[inverse]
    if std_mode == "group":
        var = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, centred**2) / (counts - ddof).clamp_min(1e-12)
        std = var.sqrt()[inverse]
    elif std_mode == "global":
        if ddof == 0:
            std = r.std(unbiased=False).expand_as(r)
        else:
            std = (((r - r.mean()) ** 2).sum() / max(r.numel() - ddof, 1e-12)).sqrt().expand_as(r)
    else:
        std = torch.ones_like(r)
        eps = 0.0
    return (centred / (std + eps)).clamp(-clip_max, clip_max)


def check_group_size(group_size: int, algorithm: str, *, alternative: str = "") -> None:
    """Refuse ``trainer.group_size < 2`` for an algorithm whose advantages are group-relative.

    :func:`group_advantages` centres each reward on its prompt group's mean (whatever ``std_mode``), so a group
    of one sample has advantage 0 whatever its reward and the update learns nothing from the rewards.

    Args:
        group_size: ``trainer.group_size``.
        algorithm: the algorithm's name, for the message.
        alternative: another fix to name after the group size (e.g. ``"algorithm.adv_stat_tracker=true ..."``).
    Raises:
        ValueError: one line naming the key and the fix.
    """
    if group_size < 2:
        other = f", or {alternative}" if alternative else ""
        raise ValueError(
            f"trainer.group_size={group_size} leaves {algorithm} one sample per prompt: its advantages are each reward minus its prompt "
            f"group's mean, so every advantage would be 0 and the rewards would train nothing; set trainer.group_size=2 or more{other}"
        )


def _group_index(group_id: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(inverse [B], n_groups)``: dense 0-based group index of each sample."""
    _, inverse = torch.unique(group_id, return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_means_fp64(rewards: torch.Tensor, group_id: torch.Tensor):
    """``(r, inverse, n_groups, counts, means)``: the rewards in float64, each sample's group index, and each group's
    size and mean (float64), after checking that ``rewards`` and ``group_id`` are both ``[B]``."""
    if rewards.shape != group_id.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_id {tuple(group_id.shape)} must both be [B]")
    r = rewards.double()
    inverse, n_groups = _group_index(group_id)
    counts = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    means = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, r) / counts
    return r, inverse, n_groups, counts, means


def group_std_keep_mask(
    rewards: torch.Tensor,
    group_id: torch.Tensor,
    *,
    min_std: float = 0.0,
) -> tuple[torch.Tensor, int]:
    """Drop groups whose rewards carry no signal (DAPO's dynamic sampling, Yu et al. 2025; Flow-GRPO logs it).

        keep_i = std_{g(i)}(r) > min_std          (population std of sample i's group)

    A group whose rewards are all equal counts as std 0 exactly, whatever the rounding of its mean; a
    one-sample group has std 0 and is dropped.

    Args:
        rewards: ``[B]`` rewards.
        group_id: ``[B]`` integer group of each sample.
        min_std: threshold (≥ 0).
    Returns:
        ``(keep, n_dropped_groups)``: ``keep`` a ``[B]`` bool mask, ``n_dropped_groups`` an int.
    """
    if min_std < 0:
        raise ValueError(f"min_std must be >= 0, got {min_std}")
    r, inverse, n_groups, counts, means = _group_means_fp64(rewards, group_id)
    var = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, (r - means[inverse]) ** 2) / counts
    hi = torch.full((n_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inverse, r, "amin")
    group_keep = (var.sqrt() > min_std) & (hi > lo)
    return group_keep[inverse], int((~group_keep).sum())


def nonzero_advantage_keep_mask(rewards: torch.Tensor, group_id: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Keep the samples whose group-relative advantage is not exactly 0 (Flow-GRPO's reference code drops the
    others before the update):

        keep_i = (r_i − mean_{g(i)}(r)) ≠ 0          (in float64)

    Every member of a group with equal rewards is dropped, and so is any sample whose reward equals its group's
    mean exactly (e.g. 0.5 in a group {0, 0.5, 0.5, 1}). Dividing by the std cannot turn a nonzero difference
    into 0, so this is the mask of ``advantage != 0`` whatever the std mode.

    Args:
        rewards: ``[B]`` rewards.
        group_id: ``[B]`` integer group of each sample.
    Returns:
        ``(keep, n_dropped_samples)``: ``keep`` a ``[B]`` bool mask.
    """
    r, inverse, n_groups, counts, means = _group_means_fp64(rewards, group_id)
    keep = (r - means[inverse]) != 0
    return keep, int((~keep).sum())


class PerPromptStatTracker:
    """DDPO's per-prompt reward normaliser (Black et al. 2023, "Training Diffusion Models with RL", sec. 4.3).

    Each prompt keeps a buffer of its last ``buffer_size`` rewards. ``update`` first appends the batch's
    rewards of each prompt to its buffer, then

        A_i = (r_i − mean_p) / (std_p + eps)

    with ``mean_p``/``std_p`` (population std) of prompt p's buffer once it holds ``min_count`` rewards,
    and of the whole current batch before that. The buffers are the tracker's whole state:
    ``state_dict()`` is JSON-serialisable and ``load_state_dict`` restores it on resume.

    Args:
        buffer_size: rewards kept per prompt (≥ 1); older ones are evicted first.
        min_count: buffer length from which the prompt's own statistics are used (0 ≤ min_count ≤ buffer_size).
        eps: added to the std.
    """

    def __init__(self, buffer_size: int = 32, min_count: int = 16, eps: float = 1e-6):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if not 0 <= min_count <= buffer_size:
            raise ValueError(f"min_count must be in [0, buffer_size={buffer_size}], got {min_count}")
        self.buffer_size = int(buffer_size)
        self.min_count = int(min_count)
        self.eps = float(eps)
        self.buffers: dict[str, deque[float]] = {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """Record ``rewards [B]`` of ``prompts`` (B strings) and return ``[B]`` fp32 advantages."""
        values = torch.as_tensor(rewards).detach().double().cpu()
        if values.ndim != 1 or len(prompts) != values.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for rewards of shape {tuple(values.shape)}; need one prompt per reward")
        if not bool(torch.isfinite(values).all()):
            raise ValueError("rewards contain NaN or inf; check the reward function")
        batch_mean, batch_std = values.mean().item(), values.std(unbiased=False).item()
        out = torch.empty_like(values)
        by_prompt: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            by_prompt.setdefault(p, []).append(i)
        for p, idx in by_prompt.items():
            buf = self.buffers.setdefault(p, deque(maxlen=self.buffer_size))
            buf.extend(values[idx].tolist())
            if len(buf) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                stored = torch.tensor(list(buf), dtype=torch.float64)
                mean, std = stored.mean().item(), stored.std(unbiased=False).item()
            out[idx] = (values[idx] - mean) / (std + self.eps)
        return out.float().to(torch.as_tensor(rewards).device)

    def stats(self) -> dict[str, float]:
        """Summary: ``num_prompts``, ``buffer_len_mean``/``min``/``max``, ``num_ready`` (≥ min_count)."""
        lengths = [len(b) for b in self.buffers.values()]
        return {
            "num_prompts": len(lengths),
            "buffer_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "buffer_len_min": min(lengths, default=0),
            "buffer_len_max": max(lengths, default=0),
            "num_ready": sum(n >= self.min_count for n in lengths),
        }

    def clear(self) -> None:
        self.buffers.clear()

    def state_dict(self) -> dict:
        """JSON-serialisable state: the settings and every prompt's buffer (oldest reward first)."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "eps": self.eps,
            "buffers": {p: list(b) for p, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output; the settings must equal this tracker's."""
        expected = {"buffer_size", "min_count", "eps", "buffers"}
        if set(state) != expected:
            raise ValueError(f"PerPromptStatTracker state needs keys {sorted(expected)}, got {sorted(state)}")
        for key in ("buffer_size", "min_count", "eps"):
            if state[key] != getattr(self, key):
                raise ValueError(f"PerPromptStatTracker state has {key}={state[key]!r} but this tracker has {getattr(self, key)!r}")
        self.buffers = {str(p): deque((float(v) for v in vals), maxlen=self.buffer_size) for p, vals in state["buffers"].items()}



def aggregate_rewards(
    rewards: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_id: torch.Tensor,
    *,
    mode: str = "sum_rewards",
    **adv_kwargs,
) -> torch.Tensor:
    """Advantages from several weighted rewards.

        "sum_rewards":    A = group_advantages(Σ_k w_k·r_k)
        "sum_advantages": A = Σ_k w_k·group_advantages(r_k)

    Only the rewards named in ``weights`` are used (others, e.g. logged components, are ignored).

    Args:
        rewards: name → ``[B]`` rewards.
        weights: name → weight; every name must be a key of ``rewards``.
        group_id: ``[B]`` integer group of each sample.
        mode: ``"sum_rewards"`` | ``"sum_advantages"``.
        **adv_kwargs: passed to ``group_advantages`` (``std_mode``, ``eps``, ``clip_max``, ``ddof``, ``dtype``).
    Returns:
        ``[B]`` advantages (fp32 unless ``dtype`` says otherwise).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown reward aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}")
    unknown = sorted(set(adv_kwargs) - {"std_mode", "eps", "clip_max", "ddof", "dtype"})
    if unknown:
        raise ValueError(f"unknown advantage options {unknown}; aggregate_rewards passes std_mode, eps, clip_max, ddof, dtype")
    if not weights:
        raise ValueError(f"weights is empty; give a weight to at least one of the rewards {sorted(rewards)}")
    missing = sorted(set(weights) - set(rewards))
    if missing:
        raise ValueError(f"weights name rewards {missing} that were not computed; available rewards: {sorted(rewards)}")
    for name in weights:
        if rewards[name].shape != group_id.shape:
            raise ValueError(f"reward {name!r} has shape {tuple(rewards[name].shape)}, group_id {tuple(group_id.shape)}")
    if mode == "sum_rewards":
        dtype = adv_kwargs.get("dtype", torch.float32)
        total = sum(float(w) * rewards[name].to(dtype) for name, w in weights.items())
        return group_advantages(total, group_id, **adv_kwargs)
    return sum(float(w) * group_advantages(rewards[name], group_id, **adv_kwargs) for name, w in weights.items())
