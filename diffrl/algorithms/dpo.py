"""Diffusion-DPO (Wallace et al. 2023): preference pairs regressed against the reference.

Online, the best and worst sample of each prompt group form a pair (groups whose rewards are all equal give
none); offline, pairs come from a jsonl/parquet file (``algorithm.preference_pairs``, read by
``diffrl.data.read_preference_pairs`` and encoded by the workers). The objective re-noises winner and loser
with shared noise and level and takes ``losses.dpo_loss`` of the trained model's and the reference's errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from tensordict import TensorDict

from diffrl.algorithms.base import BASE, Algorithm, Granularity, MicroBatchObjective, ObjectiveSpec, Pairs, RolloutPlan, StepResult, register_algorithm, sample_only_plan
from diffrl.algorithms.losses import dpo_loss
from diffrl.algorithms.objectives import forward_noise, objective_noise
from diffrl.config import AlgorithmConfig, Check, at_least, positive
from diffrl.data import read_preference_pairs
from diffrl.sampling.schedules import WindowMasks
from diffrl.sampling.seeding import Stream, derive, generator, generators


@dataclass
class PreferenceConfig(AlgorithmConfig):
    CHECKS: ClassVar[dict[str, Check]] = {"dpo_beta": positive(), "dpo_num_timesteps": at_least(1)}

    name: str = "dpo"
    trainer: str = "preference"
    dpo_beta: float = 50.0
    """Diffusion-DPO β (the reference code's beta_dpo)"""
    dpo_num_timesteps: int = 4
    """noise levels drawn per pair and update"""
    preference_pairs: Optional[str] = None
    """offline pairs (jsonl or parquet: prompt, image_0, image_1, label_0); null: online best/worst of each group"""


class DPOObjective(MicroBatchObjective):
    """Diffusion-DPO (Wallace et al. 2023) on pairs ``latents_w``/``latents_l`` (clean, ``[B, …]``) with
    ``cond``: ``num_timesteps`` noise levels per pair drawn uniformly in ``(0, 1)`` (the paper's uniform
    t), winner and loser sharing the noise and the level; errors of the trained model and of the reference
    (adapters disabled) go to ``diffrl.algorithms.losses.dpo_loss``. Its spec: the base reference, pieces per
    micro-batch, online preference pairs (:class:`OfflineDPOObjective`: pairs read from a file).
    """

    PAIRS: ClassVar[Pairs] = Pairs.ONLINE

    def __init__(self, *, dpo_beta: float, num_timesteps: int):
        if num_timesteps < 1:
            raise ValueError(f"algorithm.dpo_num_timesteps must be ≥ 1, got {num_timesteps}")
        super().__init__(ObjectiveSpec(name="dpo", granularity=Granularity.MICRO_BATCH, reference=BASE, pairs=self.PAIRS))
        self.dpo_beta, self.num_timesteps = dpo_beta, num_timesteps

    def micro_losses(self, engine, micro: TensorDict, seed: int):
        adapter = engine.adapter
        device = adapter.device
        x_w, x_l = micro["latents_w"].to(device).float(), micro["latents_l"].to(device).float()
        cond = micro["cond"].to(device)
        for k in range(self.num_timesteps):
            gens = generators([derive(seed, Stream.DPO_TIMESTEP, int(s), k) for s in micro["seeds"].tolist()])
            u = torch.stack([torch.rand((), generator=g) for g in gens]).to(device)
            sigma = (0.001 + 0.998 * u).float()
            noise = objective_noise(micro["seeds"], seed, k, x_w.shape[1:], device)
            xt_w, target_w = forward_noise(x_w, sigma, noise, adapter.prediction_type)
            xt_l, target_l = forward_noise(x_l, sigma, noise, adapter.prediction_type)
            x_both, sigma_both = torch.cat([xt_w, xt_l]), torch.cat([sigma, sigma])
            cond_both = torch.cat([cond, cond])
            target_both = torch.cat([target_w, target_l])
            pred = adapter.predict(x_both, sigma_both, cond_both, engine.sampler.guidance_scale)
            with torch.no_grad(), engine.reference_policy(self.spec.reference) as ref:
                ref_pred = ref.predict(x_both, sigma_both, cond_both, engine.sampler.guidance_scale)
            dims = tuple(range(1, pred.ndim))
            err = ((pred.float() - target_both) ** 2).mean(dim=dims)
            ref_err = ((ref_pred.float() - target_both) ** 2).mean(dim=dims)
            n = x_w.shape[0]
            loss, metrics = dpo_loss(err[:n], err[n:], ref_err[:n], ref_err[n:], dpo_beta=self.dpo_beta)
            yield loss, 1.0 / self.num_timesteps, metrics


class OfflineDPOObjective(DPOObjective):
    """:class:`DPOObjective` on offline pairs (``algorithm.preference_pairs``: no rollout, no source images)."""

    PAIRS = Pairs.OFFLINE


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
    return TensorDict(
        {
            "latents_w": traj["latents"][w, -1], "latents_l": traj["latents"][l, -1], "cond": traj["cond"][w],
            "seeds": traj["seeds"][w], "reward_gap": rewards[w] - rewards[l],
        },
        batch_size=[len(winners)],
    )


@register_algorithm("preference")
class Preference(Algorithm):
    """Diffusion-DPO, online (pairs from each step's groups) or offline (``preference_pairs``)."""

    Config = PreferenceConfig

    def __init__(self, config: PreferenceConfig, run):
        super().__init__(config, run)
        self.offline_pairs: TensorDict | None = None

    def objective(self) -> DPOObjective:
        cls = OfflineDPOObjective if self.config.preference_pairs else DPOObjective
        return cls(dpo_beta=self.config.dpo_beta, num_timesteps=self.config.dpo_num_timesteps)

    def validate(self, num_workers: int) -> None:
        if not self.config.preference_pairs and self.run.group_size < 2:
            raise ValueError(
                f"trainer.group_size={self.run.group_size} leaves algorithm={self.config.name} one sample per prompt: its online pairs are the best "
                "and worst sample of each prompt's group, so no step would have a pair to train on; set trainer.group_size=2 or more, "
                "or train on offline pairs (algorithm.preference_pairs=<jsonl or parquet file>)"
            )

    def setup(self, workers) -> None:
        if self.config.preference_pairs:
            self.offline_pairs = workers.encode_pairs(read_preference_pairs(self.config.preference_pairs))

    def needs_rollout(self, step: int) -> bool:
        return self.offline_pairs is None

    def rollout_plan(self, masks: WindowMasks) -> RolloutPlan:
        return sample_only_plan(self.run.sampler, masks, "current")

    def rows_per_step(self) -> int:
        return self.run.prompts_per_step

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        return 2 * int(record.get("pairs", 0)) * self.config.dpo_num_timesteps, 1

    def update(self, workers, traj, scores, step: int) -> StepResult:
        n = self.run.prompts_per_step
        if self.offline_pairs is not None:
            pairs_all = self.offline_pairs
            total = pairs_all.shape[0]
            order = torch.randperm(total, generator=generator(self.run.seed, Stream.OFFLINE_PAIRS, step // max(1, total // n)))
            start = (step * n) % max(1, total)
            pairs = pairs_all[order[torch.arange(start, start + n) % total]].exclude("prompts")
            record = {"pairs": pairs.shape[0]}
        else:
            pairs = online_pairs(traj, scores["rewards"])
            record = {"pairs": pairs.shape[0], "reward_gap_mean": pairs["reward_gap"].mean().item() if pairs.shape[0] else 0.0}
            if pairs.shape[0] == 0:
                return StepResult({}, record)
        return StepResult(self.train_epochs(workers, pairs, n, step), record)
