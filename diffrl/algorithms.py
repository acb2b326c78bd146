"""The three trainer types: what one RL step does after the rollout request is built.

* ``policy_gradient`` (Flow-GRPO and its variants, DanceGRPO, DDPO): sample SDE trajectories with the
  current policy, score, turn rewards into advantages, update on the trained steps' log-probs.
* ``preference`` (Diffusion-DPO): online, the best and worst sample of each prompt group form a pair
  (groups whose rewards are all equal give none); offline, pairs come from a jsonl/parquet file. The DPO
  objective regresses re-noised winners and losers against the reference.
* ``nft`` (DiffusionNFT): sample with the ``old`` policy (any solver, deterministic by default), map
  rewards to ``r ∈ [0, 1]``, train the ``default`` policy with the NFT objective, then move the old
  policy towards it by the EMA schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.advantages import PerPromptStatTracker, aggregate_rewards, group_std_keep_mask
from diffrl.losses import make_step_loss, nft_reward_to_r
from diffrl.objectives import DPOObjective, NFTObjective, old_decay
from diffrl.rollout import sample_seed
from diffrl.sde import is_deterministic
from diffrl.single_controller import arrange_for_data_parallel

TRAINER_TYPES = ("policy_gradient", "preference", "nft")


def build_loss(cfg):
    """The worker's loss for ``cfg.algorithm`` (a per-step loss or an objective)."""
    a = cfg.algorithm
    if a.trainer not in TRAINER_TYPES:
        raise ValueError(f"unknown algorithm.trainer {a.trainer!r}; choose one of {TRAINER_TYPES}")
    if a.trainer == "nft":
        return NFTObjective(nft_beta=a.nft_beta, adaptive_weight=a.nft_adaptive_weight, kl_beta=a.kl_beta, num_timesteps=a.nft_num_timesteps)
    if a.trainer == "preference":
        return DPOObjective(dpo_beta=a.dpo_beta, num_timesteps=a.dpo_num_timesteps)
    hyper = {"clip_range": a.clip_range, "kl_beta": a.kl_beta, "kl_dt_scale": a.kl_dt_scale}
    if a.loss == "grpo_guard":
        hyper.update(ratio_norm=a.ratio_norm, grad_reweight=a.grad_reweight)
    return make_step_loss(a.loss, **hyper)


class AdvantageComputer:
    """Rewards → advantages with the algorithm's options (std mode, stat tracker, several rewards)."""

    def __init__(self, cfg, reward_weights: dict[str, float]):
        a = cfg.algorithm
        self.a = a
        self.weights = reward_weights
        self.tracker = PerPromptStatTracker(a.adv_tracker_buffer, a.adv_tracker_min_count) if a.adv_stat_tracker else None

    def __call__(self, scores: dict, group_id: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        a = self.a
        if self.tracker is not None:
            return self.tracker.update(prompts, scores["rewards"]).clamp(-a.adv_clip_max, a.adv_clip_max)
        per_reward = {name: scores[f"reward/{name}"] for name in self.weights}
        return aggregate_rewards(
            per_reward, self.weights, group_id, mode=a.reward_aggregation, std_mode=a.adv_std_mode, eps=a.adv_eps, clip_max=a.adv_clip_max
        )

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict() if self.tracker is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.tracker is not None and state.get("tracker") is not None:
            self.tracker.load_state_dict(state["tracker"])


def update_policy(trainer, td: TensorDict, full_batch: int, step: int) -> dict:
    """``algorithm.epochs`` passes of optimizer steps over ``td`` on the worker group.

    The mini-batches are drawn on the driver (a seeded permutation per epoch when there are several
    mini-batches or epochs) and laid out so that each worker trains its slice of every mini-batch
    (:func:`arrange_for_data_parallel`): the update is the same for any number of workers. The number of
    mini-batches is that of a full batch (``full_batch / mini_batch_size``); rows that do not fill equal
    mini-batches divisible by the workers are left out (``rows_unused``).
    """
    cfg = trainer.cfg
    a = cfg.algorithm
    W = trainer.workers.world_size
    n = td.shape[0]
    num_mini = max(1, min(n, full_batch // int(a.mini_batch_size or full_batch)))
    per_mini = (n // num_mini) // W * W
    if per_mini == 0:
        return {"rows_unused": [float(n)]}
    used = per_mini * num_mini
    collected: dict[str, list] = {}
    base_seed = int(cfg.trainer.seed * 1000003 + step)
    for epoch in range(int(a.epochs)):
        shuffle = a.epochs > 1 or num_mini > 1
        order = torch.randperm(n, generator=torch.Generator().manual_seed(base_seed + epoch)) if shuffle else torch.arange(n)
        batch = arrange_for_data_parallel(td, mini_batch_size=per_mini, world_size=W, order=order[:used])
        batch.set_non_tensor("mini_batch_size", per_mini // W)
        batch.set_non_tensor("epochs", 1)
        batch.set_non_tensor("shuffle", False)
        batch.set_non_tensor("seed", sample_seed(base_seed, epoch, 0, 5))
        out = trainer.workers.update_actor(batch).get_non_tensor("metrics")
        for key, values in out.items():
            collected.setdefault(key, []).extend(values)
    collected["rows_unused"] = [float(n - used)]
    return collected


def policy_gradient_update(trainer, traj: TensorDict, scores: dict, step: int) -> tuple[dict, dict]:
    a = trainer.cfg.algorithm
    prompts = list(traj.get("prompts").tolist())
    traj["advantages"] = trainer.advantages(scores, traj["group_id"], prompts)
    record = {"advantage_abs_mean": traj["advantages"].abs().mean().item()}
    batch = traj
    if a.adv_drop_zero_std:
        keep, n_dropped = group_std_keep_mask(scores["rewards"], traj["group_id"])
        record["dropped_groups"] = n_dropped
        if not bool(keep.any()):
            return {}, record
        batch = traj[keep]
    del batch["metrics"]
    return update_policy(trainer, batch, traj.shape[0], step), record


def online_pairs(traj: TensorDict, rewards: torch.Tensor) -> TensorDict:
    """Best (winner) and worst (loser) sample of each prompt group; groups with equal rewards give none."""
    winners, losers = [], []
    for g in torch.unique(traj["group_id"]).tolist():
        idx = (traj["group_id"] == g).nonzero().flatten()
        r = rewards[idx]
        if bool(r.max() > r.min()):
            winners.append(int(idx[r.argmax()]))
            losers.append(int(idx[r.argmin()]))
    w, l = torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long)
    pairs = TensorDict(
        {
            "latents_w": traj["latents"][w, -1], "latents_l": traj["latents"][l, -1], "cond": traj["cond"][w],
            "seeds": traj["seeds"][w], "reward_gap": rewards[w] - rewards[l],
        },
        batch_size=[len(winners)],
    )
    return pairs


def load_offline_pairs(path: str | Path, adapter) -> TensorDict:
    """Pairs from a jsonl or parquet file with columns ``prompt``, ``image_0``, ``image_1`` (image paths,
    relative to the file) and ``label_0`` (1: image_0 preferred, 0: image_1 preferred; ties are skipped)."""
    import numpy as np
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preference pair file {path} does not exist (algorithm.preference_pairs)")
    if path.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).to_dict("records")
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    needed = {"prompt", "image_0", "image_1", "label_0"}
    images_w, images_l, prompts = [], [], []
    for i, row in enumerate(rows):
        missing = needed - set(row)
        if missing:
            raise ValueError(f"{path}: row {i} lacks {sorted(missing)}; every row needs {sorted(needed)}")
        label = float(row["label_0"])
        if label == 0.5:
            continue
        if label not in (0.0, 1.0):
            raise ValueError(f"{path}: row {i} has label_0={row['label_0']!r}; use 1 (image_0 wins), 0 (image_1 wins) or 0.5 (tie)")
        first, second = (row["image_0"], row["image_1"]) if label == 1.0 else (row["image_1"], row["image_0"])
        for target, name in ((images_w, first), (images_l, second)):
            file = (path.parent / name) if not Path(name).is_absolute() else Path(name)
            if not file.is_file():
                raise FileNotFoundError(f"{path}: row {i} names image {file}, which does not exist")
            arr = torch.from_numpy(np.array(Image.open(file).convert("RGB"))).permute(2, 0, 1)
            target.append(arr.float() / 255.0)
        prompts.append(str(row["prompt"]))
    if not prompts:
        raise ValueError(f"{path} holds no decided pairs (every label_0 is 0.5 or the file is empty)")
    unique = list(dict.fromkeys(prompts))
    cond = adapter.encode_prompts(unique)[torch.tensor([unique.index(p) for p in prompts])]
    td = TensorDict(
        {
            "latents_w": adapter.encode_images(torch.stack(images_w)).cpu(), "latents_l": adapter.encode_images(torch.stack(images_l)).cpu(),
            "cond": cond.cpu(), "seeds": torch.arange(len(prompts), dtype=torch.long),
        },
        batch_size=[len(prompts)],
    )
    td["prompts"] = NonTensorStack(*prompts)
    return td


def preference_update(trainer, traj: TensorDict | None, scores: dict | None, step: int) -> tuple[dict, dict]:
    cfg = trainer.cfg
    if trainer.offline_pairs is not None:
        pairs_all = trainer.offline_pairs
        n = cfg.trainer.prompts_per_step
        order = torch.randperm(pairs_all.shape[0], generator=torch.Generator().manual_seed(cfg.trainer.seed * 7919 + step // max(1, pairs_all.shape[0] // n)))
        start = (step * n) % max(1, pairs_all.shape[0])
        idx = order[torch.arange(start, start + n) % pairs_all.shape[0]]
        pairs = pairs_all[idx].exclude("prompts")
        record = {"pairs": pairs.shape[0]}
    else:
        pairs = online_pairs(traj, scores["rewards"])
        record = {"pairs": pairs.shape[0], "reward_gap_mean": pairs["reward_gap"].mean().item() if pairs.shape[0] else 0.0}
        if pairs.shape[0] == 0:
            return {}, record
    return update_policy(trainer, pairs, cfg.trainer.prompts_per_step, step), record


def nft_update(trainer, traj: TensorDict, scores: dict, step: int) -> tuple[dict, dict]:
    a = trainer.cfg.algorithm
    traj["nft_r"] = nft_reward_to_r(scores["rewards"], traj["group_id"], adv_clip_max=a.adv_clip_max, std_mode=a.adv_std_mode, eps=a.adv_eps)
    del traj["metrics"]
    out = update_policy(trainer, traj, traj.shape[0], step)
    decay = old_decay(a.old_schedule, step + 1, rate=a.old_decay_rate, max_decay=a.old_decay_max, delay=a.old_decay_delay)
    trainer.workers.ema_update_adapter("default", "old", decay)
    return out, {"r_mean": traj["nft_r"].mean().item(), "old_decay": decay}


def rollout_policy_and_masks(cfg, masks) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    """Which policy samples and the (trained, stochastic) masks for the trainer type."""
    s, a = cfg.sampler, cfg.algorithm
    if a.trainer == "policy_gradient":
        return "current", masks.trained, masks.stochastic
    stochastic = None if is_deterministic(s.kind, s.noise_level) else masks.stochastic
    none_trained = torch.zeros_like(masks.trained)
    return ("old" if a.trainer == "nft" else "current"), none_trained, (stochastic if stochastic is not None else none_trained)
