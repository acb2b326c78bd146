"""Workers with the API of verl-omni's ``TrainingWorker`` / ``ActorRolloutRefWorker``.

Workers receive and return TensorDicts. Control flags travel as non-tensor entries of the input
TensorDict (``mini_batch_size``, ``update_seeds``, ``seed``, ``no_lora_adapter``, ``disable_auto_offload``).
A worker group (``diffrl.distributed.controller``) runs them in-process or as Ray actors; each method's
``@register`` mode says how the group splits its input and merges its outputs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

from diffrl import checkpoint
from diffrl.config import ModelConfig, OptimConfig, SamplerConfig
from diffrl.distributed import weight_sync
from diffrl.distributed.controller import Dispatch, register
from diffrl.engine import lora, parallel
from diffrl.engine.engine import DiffusionEngine
from diffrl.engine.flops import counter_for_adapter
from diffrl.sampling.request import SampleRequest, run_request
from pipelines import build_adapter

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


def pop_flag(data: TensorDict, key: str, default=None):
    """Remove and return a non-tensor control flag (``default`` when absent)."""
    if key not in data.keys():
        return default
    value = data.get_non_tensor(key)
    del data[key]
    return value


def metrics_td(metrics: dict, **tensors) -> TensorDict:
    td = TensorDict(tensors, batch_size=[])
    td.set_non_tensor("metrics", metrics)
    return td


@dataclass(kw_only=True)
class WorkerConfig:
    """Everything a worker needs to build its model and engine: the components' own configs."""

    model: ModelConfig
    """the model family, its weights and LoRA / FSDP2 / compile settings"""
    sampler: SamplerConfig
    """how rollouts are drawn (and how training re-scores them)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """the optimizer (``algorithm.lr`` …)"""
    micro_batch_size: int | None = None
    """trajectories per forward/backward (``algorithm.micro_batch_size``)"""
    seed: int = 0
    """seed of the LoRA initialisation (``trainer.seed``)"""
    old_policy: bool = False
    """keep an ``old`` policy from the start (the algorithm asks for it)"""
    total_steps: int | None = None
    """optimizer steps of the whole run (linear / cosine learning-rate schedules)"""


class TrainingWorker:
    """Trains or scores trajectories with one engine (seed API: ``reset``, ``to``, ``set_loss_fn``,
    ``train_batch``, ``infer_batch``, ``train_mini_batch``, adapters, checkpoints).

    Args:
        config: a :class:`WorkerConfig`.
        adapter: an already built model adapter (default: built from ``config.model``).
    """

    def __init__(self, config: WorkerConfig, adapter=None):
        self.config = config
        self.adapter = adapter if adapter is not None else build_adapter(config.model.family, **config.model.adapter_kwargs())
        self.engine = DiffusionEngine(
            self.adapter, model=config.model, optim=config.optim, sampler=config.sampler, micro_batch_size=config.micro_batch_size,
            seed=config.seed, old_policy=config.old_policy, total_steps=config.total_steps,
        )
        self.loss_fn = None

    def reset(self) -> None:
        """Attach LoRA (or unfreeze the denoiser) and build the optimizer (idempotent)."""
        self.engine.initialize()

    @register(Dispatch.ONE_TO_ALL)
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        if model:
            self.engine.to(device)

    @register(Dispatch.ONE_TO_ALL)
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
        """One optimizer step per consecutive mini-batch of ``mini_batch_size`` rows of ``data``, in order.

        The driver (``Algorithm.train_epochs``) draws the mini-batches, their order over epochs and one seed
        per optimizer step (flag ``update_seeds``); this is the only mini-batch loop. Flag ``ema_decays`` (one list
        per optimizer step, ``eval.ema_cadence=optimizer_step``) moves the ``ema`` adapter after each step. Returns
        every optimizer step's metrics as lists under ``metrics``.
        """
        pop_flag(data, "disable_auto_offload", False)
        batch_size = data.shape[0]
        mini_batch_size = int(pop_flag(data, "mini_batch_size", None) or batch_size)
        if batch_size % mini_batch_size:
            raise ValueError(f"batch of {batch_size} trajectories is not divisible by mini_batch_size={mini_batch_size}")
        num_mini_batches = batch_size // mini_batch_size
        seeds = pop_flag(data, "update_seeds", None) or [0] * num_mini_batches
        if len(seeds) != num_mini_batches:
            raise ValueError(f"update_seeds has {len(seeds)} seeds for {num_mini_batches} mini-batches")
        ema_decays = pop_flag(data, "ema_decays", None) or [[] for _ in range(num_mini_batches)]  # eval.ema_cadence=optimizer_step
        if len(ema_decays) != num_mini_batches:
            raise ValueError(f"ema_decays has {len(ema_decays)} entries for {num_mini_batches} mini-batches")
        collected: dict[str, list] = defaultdict(list)
        for index in range(num_mini_batches):
            mini = data[index * mini_batch_size : (index + 1) * mini_batch_size]
            mini.set_non_tensor("seed", int(seeds[index]))
            for key, value in self.train_batch(mini).get_non_tensor("metrics").items():
                collected[key].append(value)
            for decay in ema_decays[index]:  # the evaluated EMA follows the weights of this optimizer step
                lora.ema_update_adapter(self.engine.module, "default", "ema", float(decay))
        return metrics_td(dict(collected))

    @register(Dispatch.ONE_TO_ALL)
    def copy_adapter(self, source: str = "default", target: str = "old") -> None:
        """``target ← source``; ``default → old`` also works for full fine-tuning (a frozen copy)."""
        if (source, target) == ("default", "old"):
            self.engine.copy_to_old()
        else:
            lora.copy_adapter(self.engine.module, source, target)

    @register(Dispatch.ONE_TO_ALL)
    def ema_update_adapter(self, source: str = "default", target: str = "old", decay: float = 0.0) -> None:
        """``target ← decay·target + (1 − decay)·source`` (``default → old`` also for full fine-tuning)."""
        if (source, target) == ("default", "old"):
            self.engine.ema_to_old(decay)
        else:
            lora.ema_update_adapter(self.engine.module, source, target, decay)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str | Path, global_step: int = 0, extra_state: dict | None = None) -> Path:
        return checkpoint.save_engine(self.engine, local_path, global_step=global_step, extra_state=extra_state)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str | Path, hashes: bool = True) -> dict:
        return checkpoint.load_engine(self.engine, local_path, hashes=hashes)


class ActorRolloutRefWorker(TrainingWorker):
    """The hybrid worker: actor, rollout and reference on one module (seed API).

    With LoRA the reference is the actor with its adapters disabled and the rollout samples from the
    actor's own module, so ``update_weights`` has nothing to move (colocated, in place). The model is built
    by :meth:`init_model`, in the worker's own process (a Ray actor builds it on its device).

    Args:
        config: a :class:`WorkerConfig`.
        role: one of ``actor | rollout | ref | actor_rollout | actor_rollout_ref``.
    """

    def __init__(self, config: WorkerConfig, role: str = "actor_rollout_ref"):
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose one of {ROLES}")
        self.config = config
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref")
        self.engine = None
        self.weights_version = 0
        self.sync_channel: weight_sync.WeightSyncChannel | None = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        TrainingWorker.__init__(self, self.config)
        if self._is_actor or self._is_ref:
            self.reset()

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, data: TensorDict) -> TensorDict:
        """Sample the request batch ``data`` (:func:`diffrl.sampling.request.sample_batch`: ``prompts``, ``seeds``,
        ``group_id``, optionally ``init_seeds`` and ``source_images``, and its typed
        :class:`~diffrl.sampling.request.SampleRequest`); sampler settings come from the config."""
        if not self._is_rollout:
            raise RuntimeError(f"generate_sequences needs a rollout role, this worker is {self.role!r}")
        start = time.perf_counter()
        self.engine.module.eval()
        request = SampleRequest.of(data)
        # evaluations sample the model-precision policy
        with self.engine.policy(request.policy), torch.no_grad(), self.engine.rollout_weights(low_precision=not request.evaluation):
            td = run_request(self.adapter, self.config.sampler, data)
        td.set_non_tensor("metrics", {"rollout_seconds": time.perf_counter() - start, "weights_version": self.weights_version})
        return td

    @register(Dispatch.DP_COMPUTE)
    def infer_ref_batch(self, data: TensorDict) -> TensorDict:
        """Log-probs of ``data`` under the reference policy (the actor with its adapters disabled)."""
        data.set_non_tensor("no_lora_adapter", True)
        return self.infer_batch(data)

    @register(Dispatch.DP_COMPUTE)
    def infer_actor_batch(self, data: TensorDict) -> TensorDict:
        """Log-probs of ``data`` under the current policy."""
        return self.infer_batch(data)

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, data: TensorDict) -> TensorDict:
        """This rank's slice of every mini-batch (:meth:`train_mini_batch`)."""
        if not self._is_actor:
            raise RuntimeError(f"update_actor needs an actor role, this worker is {self.role!r}")
        return self.train_mini_batch(data)

    @register(Dispatch.ONE_TO_ALL)
    def update_weights(self, global_steps: int | None = None) -> None:
        """Make the rollout path use the actor's current weights.

        Colocated in one process the rollout samples with the actor's own module (LoRA included), so
        the sync is in place; the version counter records which update the rollout sees (reported with
        every rollout as ``weights_version``). Rollout replicas (``diffrl.distributed.rollout``) get the
        weights of this version afterwards through :meth:`send_weights`.
        """
        self.weights_version = global_steps if global_steps is not None else self.weights_version + 1

    # -- weight sync to rollout replicas (diffrl.distributed.rollout) ------------------------------------
    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, backend: str, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Rank 0 joins the sync group as its sync rank 0 (the sender); other ranks only gather for it."""
        if parallel.rank() == 0:
            self.sync_channel = weight_sync.WeightSyncChannel(backend, host, port, 0, world_size, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def sync_adapters(self) -> list[str]:
        """The LoRA adapters the replicas must hold (``default`` and, when the algorithm keeps one, ``old``)."""
        return weight_sync.adapter_names(self.engine)

    @register(Dispatch.ONE_TO_ALL)
    def send_weights(self, version: int, bucket_bytes: int) -> dict:
        """Broadcast the trained weights to the replicas (``weight_sync.send_weights``; every rank gathers, rank 0 sends).

        Returns rank 0's ``{"hash", "bytes", "buckets", "seconds", "hash_seconds", "digest", "version"}``."""
        if version != self.weights_version:
            raise RuntimeError(f"send_weights of version {version}, but this actor's weights are version {self.weights_version} (call update_weights first)")
        stats = weight_sync.send_weights(self.engine, self.sync_channel, bucket_bytes)
        return {**stats, "version": self.weights_version}

    @register(Dispatch.ONE_TO_ALL)
    def default_prompts(self) -> list[str] | None:
        """The model family's built-in prompt set."""
        return self.adapter.default_prompts()

    @register(Dispatch.ONE_TO_ALL)
    def encode_pairs(self, pairs: TensorDict) -> TensorDict:
        """Preference pairs (``diffrl.data.read_preference_pairs``: ``images_w``, ``images_l``, ``prompts``)
        encoded by this worker's model: ``latents_w``, ``latents_l``, ``cond``, ``seeds`` (the pair index)."""
        prompts = list(pairs.get("prompts").tolist())
        unique = list(dict.fromkeys(prompts))
        cond = self.adapter.encode_prompts(unique)[torch.tensor([unique.index(p) for p in prompts])]
        td = TensorDict(
            {
                "latents_w": self.adapter.encode_images(pairs["images_w"]).cpu(), "latents_l": self.adapter.encode_images(pairs["images_l"]).cpu(),
                "cond": cond.cpu(), "seeds": torch.arange(len(prompts), dtype=torch.long),
            },
            batch_size=[len(prompts)],
        )
        td["prompts"] = NonTensorStack(*prompts)
        return td

    @register(Dispatch.ONE_TO_ALL)
    def flops_counter(self, peak_flops: float | None = None):
        """A DiffusionFlopsCounter of this worker's denoiser at the sampler's image size (its device's
        peak from the table unless ``peak_flops`` is given); None for a denoiser without a formula."""
        adapter, s = self.adapter, self.config.sampler
        device = adapter.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        try:
            m = self.config.model
            return counter_for_adapter(adapter, s.height, s.width, lora_rank=m.lora.rank, device_name=name, peak_flops=peak_flops,
                                       fused_rollout=m.fuse_lora_rollout and m.lora.rank > 0)
        except ValueError:
            return None

    @register(Dispatch.ONE_TO_ALL)
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Whole tensors of the trained parameters (every rank gathers its shards)."""
        return {n: t.cpu() for n, t in self.engine.trainable_state().items()}
