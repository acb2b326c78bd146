"""The distributed config's checks (``distributed.*``): the backend can run the workers asked for, and the run's
batch (:class:`~diffrl.config.BatchPlan`) splits evenly over its ranks, mini-batches, reward chunks and rollout
replicas, and the model's sequence-parallel groups over its ranks and tokens, before any work (:func:`validate_distributed`, also
``diffrl.recipes.check_sizes``); and the rollouts these settings make
against what the algorithm's objective declares (:func:`check_objective`). Each error is one line naming the keys and
what is valid."""

from __future__ import annotations

import importlib.util

from diffrl.algorithms import Algorithm, registered_where
from diffrl.config import BatchPlan, DistributedConfig, ModelConfig, SamplerConfig
from diffrl.engine import sequence_parallel


def check_backend(dist: DistributedConfig) -> None:
    """The backend can run the workers asked for, before any size is checked: ``local`` runs one worker in this
    process; ``ray`` needs Ray installed (one line naming the ``pip install`` when it is not)."""
    W, R = int(dist.num_workers), int(dist.rollout_replicas)
    if dist.backend == "local" and W > 1:
        raise ValueError(f"distributed.backend=local runs one worker in this process; for distributed.num_workers={W} set distributed.backend=ray "
                         "(pip install -e '.[ray]'), or distributed.num_workers=1")
    if dist.backend == "ray" or R:
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"{'distributed.backend=ray' if dist.backend == 'ray' else f'distributed.rollout_replicas={R}'} needs Ray, which is not "
                             "installed: pip install -e '.[ray]'")


def validate_distributed(dist: DistributedConfig, batch: BatchPlan, model: ModelConfig, sampler: SamplerConfig, family: type, *, async_chunks: int,
                         ema: bool, backend: bool = True, algorithm: Algorithm | None = None) -> None:
    """The global sizes of ``batch`` against workers, mini-batches, reward chunks (``reward.async_chunks``) and rollout
    replicas; ``model``'s FSDP2 / fused-LoRA settings against the ranks, ``eval.ema`` (``ema``) against full fine-tuning;
    then the run's ``algorithm`` (when given: :func:`check_objective`); last ``model.sequence_parallel`` against the
    ``family`` (the adapter class of ``model.family``), the ranks and the heads and tokens at ``sampler``'s size (``diffrl.engine.sequence_parallel.check_config``).
    The backend first (:func:`check_backend`) and the sequence-parallel groups last unless ``backend`` is false
    (``diffrl plan`` plans N Ray ranks on a machine without Ray, and checks the groups over the ranks it plans)."""
    P, G = batch.prompts_per_step, batch.group_size
    if P < 1 or G < 1:
        raise ValueError(f"trainer.prompts_per_step and trainer.group_size must be ≥ 1, got {P} and {G}")
    W = batch.num_workers
    if W < 1:
        raise ValueError(f"distributed.num_workers must be ≥ 1, got {W}")
    if backend:
        check_backend(dist)
    rows, mini = batch.rows, batch.mini_batch
    if rows % mini:
        raise ValueError(
            f"algorithm.mini_batch_size={mini} does not divide the {rows} trajectories of a step "
            f"(trainer.prompts_per_step × trainer.group_size); valid sizes: {[d for d in range(1, rows + 1) if rows % d == 0]}"
        )
    k, dp = batch.sequence_parallel, batch.dp_size
    if dp > 1:
        if rows % dp or mini % dp:
            valid = [d for d in range(dp, rows + 1, dp) if rows % d == 0]
            over = f"distributed.num_workers={W}" if dp == W else f"{dp} data-parallel groups (distributed.num_workers={W} / model.sequence_parallel={k})"
            raise ValueError(
                f"{rows} trajectories per step (mini-batches of {mini}) cannot be split evenly over {over}: "
                f"prompts_per_step × group_size and algorithm.mini_batch_size must be multiples of {dp} "
                f"(valid mini_batch_size values: {valid})"
            )
    if W > 1:
        if not model.fsdp:
            raise ValueError(
                f"model.fsdp=false with distributed.num_workers={W}: the workers would train unsynchronised copies (gradients are "
                "averaged by FSDP2); keep model.fsdp=true or use distributed.num_workers=1"
            )
        if model.fuse_lora_rollout and not int(dist.rollout_replicas):
            raise ValueError(
                f"model.fuse_lora_rollout=true with distributed.num_workers={W}: the actor ranks sample with FSDP2-sharded weights, which "
                "cannot be fused; use rollout replicas (distributed.rollout_replicas ≥ 1, whole weights), distributed.num_workers=1 or model.fuse_lora_rollout=false"
            )
    if model.fuse_lora_rollout and int(model.lora.rank) == 0:
        raise ValueError("model.fuse_lora_rollout=true needs a LoRA adapter (model.lora.rank > 0); full fine-tuning has nothing to fuse")
    if ema and int(model.lora.rank) == 0:
        raise ValueError("eval.ema=true keeps an EMA of the LoRA (model.lora.rank > 0); full fine-tuning has none: train a LoRA or set eval.ema=false")
    C = int(async_chunks)
    if C < 1 or P % C:
        valid = [d for d in range(1, P + 1) if P % d == 0]
        raise ValueError(f"reward.async_chunks={C} must divide trainer.prompts_per_step={P} (chunks are whole prompt groups); valid: {valid}")
    if dp > 1 and (rows // C) % dp:
        valid = [d for d in range(1, P + 1) if P % d == 0 and (rows // d) % dp == 0]
        over = f"distributed.num_workers={W}" if dp == W else f"the {dp} data-parallel groups"
        raise ValueError(f"reward.async_chunks={C} gives chunks of {rows // C} rollouts, not divisible by {over}; valid: {valid}")
    R, s = int(dist.rollout_replicas), int(dist.max_staleness)
    if R and dist.backend != "ray":
        raise ValueError(f"distributed.rollout_replicas={R} needs distributed.backend=ray (each replica is a Ray actor beside the actor ranks)")
    if s and not R:
        raise ValueError(f"distributed.max_staleness={s} needs rollout replicas (distributed.rollout_replicas ≥ 1): rollouts on the actor ranks cannot run ahead of training")
    if R and (rows // C) % R:
        valid = [d for d in range(1, rows // C + 1) if (rows // C) % d == 0]
        raise ValueError(f"distributed.rollout_replicas={R} must divide the {rows // C} rollouts of a request (prompts_per_step × group_size / reward.async_chunks); valid: {valid}")
    if s and C > 1:
        raise ValueError(f"reward.async_chunks={C} with distributed.max_staleness={s}: off-policy rollouts already overlap rewards with sampling; set reward.async_chunks=1")
    if algorithm is not None:
        check_objective(dist, model, algorithm, num_workers=W)
    if backend:
        sequence_parallel.check_config(model, sampler, family, num_workers=W, backend=dist.backend)


def check_objective(dist: DistributedConfig, model: ModelConfig, algorithm: Algorithm, *, num_workers: int) -> None:
    """The algorithm against the run's ranks and rollouts, before any work: first its own settings against the
    ``num_workers`` ranks (``Algorithm.validate``), then the rollouts of ``distributed.*`` and ``model.rollout_precision``
    against what its objective declares (``algorithm.spec``, an :class:`~diffrl.algorithms.ObjectiveSpec`): off-policy
    rollouts (replicas with staleness, FP8 rollouts) need an objective that corrects them (the algorithms able to are
    named from the registry); replicas cannot sync a full fine-tune's old policy. What the run does follows from the
    settings and the declared spec (``diffrl.rollout_driver.low_precision_rollouts``)."""
    algorithm.validate(num_workers)
    d, m = dist, model
    spec = algorithm.spec
    corrects = spec.corrects_off_policy  # its loss weights behaviour log-probs by truncated IS
    used = algorithm.name if spec.name == algorithm.name else f"{algorithm.name} (loss {spec.name})"
    if d.max_staleness and not corrects:
        able = ", ".join(registered_where(lambda s: s.corrects_off_policy, algorithm.run)) or "none is registered"
        raise ValueError(f"distributed.max_staleness={d.max_staleness} needs a loss that corrects off-policy rollouts by truncated importance "
                         f"weights (registered, at their defaults: {able}), not {used}; set distributed.max_staleness=0")
    if m.rollout_precision != "model" and not corrects:
        able = ", ".join(registered_where(lambda s: s.corrects_off_policy, algorithm.run)) or "none is registered"
        raise ValueError(f"model.rollout_precision={m.rollout_precision} samples with another policy than the trained one, and "
                         f"{algorithm.name}'s loss {spec.name} does not correct that (its log-probs need truncated importance "
                         f"weights: {able}); set model.rollout_precision=model")
    if d.rollout_replicas and m.lora.rank == 0 and spec.old_policy:
        raise ValueError(f"distributed.rollout_replicas={d.rollout_replicas} with full fine-tuning (model.lora.rank=0) cannot sync {algorithm.name}'s "
                         "old policy (a frozen copy on the actor); train a LoRA or set distributed.rollout_replicas=0")


__all__ = ["check_backend", "check_objective", "validate_distributed"]
