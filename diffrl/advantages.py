"""Advantages from rewards, normalised within prompt groups (GRPO, Shao et al. 2024; Flow-GRPO).

    A_i = clip((r_i − mean_{g(i)}) / (std + eps), −clip_max, clip_max)

``std`` is the reward std of sample i's group (``std_mode="group"``, GRPO), the std of the whole
batch (``"global"``, Flow-GRPO's default, which keeps low-variance groups from being amplified), or 1
(``"none"``, Dr.GRPO). Stds are population stds (``unbiased=False``).
"""

from __future__ import annotations

import torch

STD_MODES = ("group", "global", "none")


def group_advantages(
    rewards: torch.Tensor,
    group_id: torch.Tensor,
    *,
    std_mode: str = "global",
    eps: float = 1e-4,
    clip_max: float = 5.0,
) -> torch.Tensor:
    """Group-normalised advantages.

    Args:
        rewards: ``[B]`` rewards.
        group_id: ``[B]`` integer group of each sample (samples of one prompt share a group).
        std_mode: ``"group"`` | ``"global"`` | ``"none"``.
        eps: added to the std.
        clip_max: advantages are clipped to ``[−clip_max, clip_max]``.

    Returns:
        ``[B]`` fp32 advantages.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown advantage std_mode {std_mode!r}; choose one of {STD_MODES}")
    r = rewards.float()
    _, inverse = torch.unique(group_id, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    counts = torch.zeros(n_groups, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    means = torch.zeros(n_groups, device=r.device).index_add_(0, inverse, r) / counts
    centred = r - means[inverse]
    if std_mode == "group":
        var = torch.zeros(n_groups, device=r.device).index_add_(0, inverse, centred**2) / counts
        std = var.sqrt()[inverse]
    elif std_mode == "global":
        std = r.std(unbiased=False).expand_as(r)
    else:
        std = torch.ones_like(r)
        eps = 0.0
    return (centred / (std + eps)).clamp(-clip_max, clip_max)
