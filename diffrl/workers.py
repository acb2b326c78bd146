"""Training workers with the API of verl-omni's ``TrainingWorker`` / ``ActorRolloutRefWorker``.

Workers receive and return TensorDicts. Control flags travel as non-tensor entries of the input
TensorDict (``mini_batch_size``, ``epochs``, ``seed``, ``no_lora_adapter``, ``disable_auto_offload``).
In this version the workers run in-process (the embedded default).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

from diffrl import adapters as lora
from diffrl import checkpoint
from diffrl.engine import DiffusionEngine, EngineSettings
from diffrl.evaluation import deterministic_settings
from diffrl.rollout import SamplerSettings, sample_seed, sample_trajectories
from diffrl.single_controller.base import Dispatch, register

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


def pop_flag(data: TensorDict, key: str, default=None):
    """Remove and return a non-tensor control flag (``default`` when absent)."""
    if key not in data.keys():
        return default
    value = data.get_non_tensor(key)
    del data[key]
    return value


def get_flag(data: TensorDict, key: str, default=None):
    return data.get_non_tensor(key) if key in data.keys() else default


def metrics_td(metrics: dict, **tensors) -> TensorDict:
    td = TensorDict(tensors, batch_size=[])
    td.set_non_tensor("metrics", metrics)
    return td


@dataclass(kw_only=True)
class TrainingWorkerConfig:
    """Everything a TrainingWorker needs to build its engine."""

    model_family: str
    """model family name (pipelines registry)"""
    model_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the family's adapter (path, dtype, device, …)"""
    engine: EngineSettings = field(default_factory=EngineSettings)
    sampler: SamplerSettings = field(default_factory=lambda: SamplerSettings(num_steps=10))


class TrainingWorker:
    """Trains or scores trajectories with one engine (seed API: reset, to, set_loss_fn, train_batch, …)."""

    def __init__(self, config: TrainingWorkerConfig, adapter=None):
        from pipelines import build_adapter

        self.config = config
        self.adapter = adapter if adapter is not None else build_adapter(config.model_family, **config.model_kwargs)
        self.engine = DiffusionEngine(self.adapter, config.engine, config.sampler)
        self.loss_fn = None

    def reset(self) -> None:
        """Build LoRA and the optimizer (first call)."""
        self.engine.initialize()

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        if model:
            self.engine.to(device)

    def set_loss_fn(self, loss_fn) -> None:
        self.loss_fn = loss_fn

    def train_batch(self, data: TensorDict) -> TensorDict:
        """One optimizer step on ``data`` (a mini-batch; flag ``seed`` seeds objectives' noise); returns
        ``metrics`` (non-tensor)."""
        seed = int(pop_flag(data, "seed", 0))
        start = time.perf_counter()
        output = self.engine.train_batch(data, self.loss_fn, seed=seed)
        metrics = dict(output["metrics"], loss=output["loss"], train_seconds=time.perf_counter() - start)
        return metrics_td(metrics)

    def infer_batch(self, data: TensorDict) -> TensorDict:
        """Recompute ``log_probs`` of ``data``; flag ``no_lora_adapter=True`` scores with the reference."""
        reference = bool(pop_flag(data, "no_lora_adapter", False))
        start = time.perf_counter()
        out = self.engine.infer_batch(data, reference=reference)
        out.set_non_tensor("metrics", {"infer_seconds": time.perf_counter() - start})
        return out

    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        """Split ``data`` into mini-batches of ``mini_batch_size`` and run ``epochs`` passes over them.

        The order within each epoch is a permutation seeded by ``seed + epoch``. Returns every
        optimizer step's metrics as lists under ``metrics``.
        """
        pop_flag(data, "disable_auto_offload", False)
        batch_size = data.shape[0]
        mini_batch_size = int(pop_flag(data, "mini_batch_size", None) or batch_size)
        epochs = int(pop_flag(data, "epochs", 1))
        seed = int(pop_flag(data, "seed", 0))
        shuffle = bool(pop_flag(data, "shuffle", True))
        if batch_size % mini_batch_size:
            raise ValueError(f"batch of {batch_size} trajectories is not divisible by mini_batch_size={mini_batch_size}")
        num_mini_batches = batch_size // mini_batch_size
        collected: dict[str, list] = defaultdict(list)
        for epoch in range(epochs):
            permute = shuffle and (epochs > 1 or num_mini_batches > 1)
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(seed + epoch)) if permute else torch.arange(batch_size)
            for index, rows in enumerate(torch.tensor_split(order, num_mini_batches)):
                mini = data[rows]
                mini.set_non_tensor("seed", sample_seed(seed, epoch, index, 3))
                out = self.train_batch(mini)
                for key, value in out.get_non_tensor("metrics").items():
                    collected[key].append(value)
        return metrics_td(dict(collected))

    def copy_adapter(self, source: str = "default", target: str = "old") -> None:
        """``target ← source``; ``default → old`` also works for full fine-tuning (a frozen copy)."""
        if (source, target) == ("default", "old"):
            self.engine.copy_to_old()
        else:
            lora.copy_adapter(self.engine.module, source, target)

    def ema_update_adapter(self, source: str = "default", target: str = "old", decay: float = 0.0) -> None:
        """``target ← decay·target + (1 − decay)·source`` (``default → old`` also for full fine-tuning)."""
        if (source, target) == ("default", "old"):
            self.engine.ema_to_old(decay)
        else:
            lora.ema_update_adapter(self.engine.module, source, target, decay)

    def save_checkpoint(self, local_path: str | Path, global_step: int = 0, extra_state: dict | None = None) -> Path:
        return checkpoint.save_engine(self.engine, local_path, global_step=global_step, extra_state=extra_state)

    def load_checkpoint(self, local_path: str | Path) -> dict:
        return checkpoint.load_engine(self.engine, local_path)


class ActorRolloutRefWorker:
    """The hybrid worker: actor, rollout and reference on one module (seed API).

    With LoRA the reference is the actor with its adapters disabled and the rollout samples from the
    actor's own module, so ``update_weights`` has nothing to move (colocated, in place).

    Args:
        config: a :class:`TrainingWorkerConfig`.
        role: one of ``actor | rollout | ref | actor_rollout | actor_rollout_ref``.
    """

    def __init__(self, config: TrainingWorkerConfig, role: str = "actor_rollout_ref"):
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose one of {ROLES}")
        self.config = config
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref")
        self.actor: TrainingWorker | None = None
        self.weights_version = 0

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.actor = TrainingWorker(self.config)
        if self._is_actor or self._is_ref:
            self.actor.reset()

    @register(Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn) -> None:
        self.actor.set_loss_fn(loss_fn)

    @register(Dispatch.ONE_TO_ALL)
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        self.actor.to(device, model=model, optimizer=optimizer, grad=grad)

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, data: TensorDict) -> TensorDict:
        """Sample trajectories: ``data`` holds non-tensor ``prompts`` and tensor ``seeds``, ``group_id``,
        optionally ``init_seeds`` and the non-tensor flags ``sde_mask [K]``, ``stochastic_mask [K]``,
        ``micro_batch_size``; sampler settings come from the config."""
        if not self._is_rollout:
            raise RuntimeError(f"generate_sequences needs a rollout role, this worker is {self.role!r}")
        prompts = list(data.get("prompts").tolist()) if hasattr(data.get("prompts"), "tolist") else list(data.get("prompts"))
        start = time.perf_counter()
        self.actor.engine.module.eval()
        policy = get_flag(data, "policy", "current")
        if policy not in ("current", "old"):
            raise ValueError(f"generate_sequences: policy must be 'current' or 'old', got {policy!r}")
        ctx = self.actor.engine.old_policy() if policy == "old" else contextlib.nullcontext()
        with ctx:
            td = self._sample(data, prompts)
        td.set_non_tensor("metrics", {"rollout_seconds": time.perf_counter() - start, "weights_version": self.weights_version})
        return td

    def _sample(self, data: TensorDict, prompts: list[str]) -> TensorDict:
        settings = self.config.sampler
        eval_steps = get_flag(data, "eval_num_steps")
        if eval_steps:  # deterministic evaluation, no trained steps
            settings = deterministic_settings(settings, self.actor.adapter.prediction_type, int(eval_steps))
            return sample_trajectories(
                self.actor.adapter, prompts, settings=settings, seeds=data["seeds"].tolist(), group_id=data["group_id"],
                micro_batch_size=get_flag(data, "micro_batch_size"),
            )
        return sample_trajectories(
            self.actor.adapter, prompts, settings=settings, seeds=data["seeds"].tolist(),
            sde_mask=get_flag(data, "sde_mask"), stochastic_mask=get_flag(data, "stochastic_mask"),
            init_seeds=data["init_seeds"].tolist() if "init_seeds" in data.keys() else None, group_id=data["group_id"],
            micro_batch_size=get_flag(data, "micro_batch_size"), record_means=bool(get_flag(data, "record_means", False)),
        )

    @register(Dispatch.DP_COMPUTE)
    def infer_ref_batch(self, data: TensorDict) -> TensorDict:
        data.set_non_tensor("no_lora_adapter", True)
        return self.actor.infer_batch(data)

    @register(Dispatch.DP_COMPUTE)
    def infer_actor_batch(self, data: TensorDict) -> TensorDict:
        return self.actor.infer_batch(data)

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, data: TensorDict) -> TensorDict:
        if not self._is_actor:
            raise RuntimeError(f"update_actor needs an actor role, this worker is {self.role!r}")
        return self.actor.train_mini_batch(data)

    @register(Dispatch.ONE_TO_ALL)
    def copy_adapter(self, source: str = "default", target: str = "old") -> None:
        self.actor.copy_adapter(source, target)

    @register(Dispatch.ONE_TO_ALL)
    def ema_update_adapter(self, source: str = "default", target: str = "old", decay: float = 0.0) -> None:
        self.actor.ema_update_adapter(source, target, decay)

    @register(Dispatch.ONE_TO_ALL)
    def update_weights(self, global_steps: int | None = None) -> None:
        """Make the rollout path use the actor's current weights.

        Colocated in one process the rollout samples with the actor's own module (LoRA included), so
        the sync is in place; the version counter records which update the rollout sees.
        """
        self.weights_version = global_steps if global_steps is not None else self.weights_version + 1

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, global_step: int = 0, extra_state: dict | None = None) -> Path:
        return self.actor.save_checkpoint(local_path, global_step, extra_state)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path) -> dict:
        return self.actor.load_checkpoint(local_path)

    @register(Dispatch.ONE_TO_ALL)
    def default_prompts(self) -> list[str] | None:
        """The model family's built-in prompt set."""
        return self.actor.adapter.default_prompts()

    @register(Dispatch.ONE_TO_ALL)
    def load_offline_pairs(self, path: str) -> TensorDict:
        """Preference pairs of a jsonl/parquet file, encoded by this worker's model (see ``diffrl.algorithms``)."""
        from diffrl.algorithms import load_offline_pairs

        return load_offline_pairs(path, self.actor.adapter)

    @register(Dispatch.ONE_TO_ALL)
    def flops_counter(self, peak_flops: float | None = None):
        """A DiffusionFlopsCounter of this worker's denoiser at the sampler's image size (its device's
        peak from the table unless ``peak_flops`` is given); None for a denoiser without a formula."""
        from diffrl.flops import counter_for_adapter

        adapter, s = self.actor.adapter, self.config.sampler
        device = adapter.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        try:
            return counter_for_adapter(adapter, s.height, s.width, lora_rank=self.config.engine.lora_rank, device_name=name, peak_flops=peak_flops)
        except ValueError:
            return None

    @register(Dispatch.ONE_TO_ALL)
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Whole tensors of the trained parameters (every rank gathers its shards)."""
        return {n: t.cpu() for n, t in self.actor.engine.trainable_state().items()}
