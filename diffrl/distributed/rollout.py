"""Rollout replicas: the rollout role as its own Ray actors next to the actor ranks, fed by the driver.

A replica (:class:`RolloutWorker`) holds its own copy of the model (with LoRA: the frozen base and its own
adapters, which the sync overwrites), samples the requests the driver sends it and returns trajectories
whose ``log_probs`` are the behaviour policy's and whose ``weights_version [B]`` names the actor update that
produced its weights. :class:`RolloutReplicas` is the driver's side: it builds the replicas, splits each
request over them (contiguous equal chunks, as ``Dispatch.DP_COMPUTE``), lets requests run ahead of the
training (bounded staleness, ``distributed.max_staleness``), and pushes the actor's weights to every replica
(``diffrl.distributed.weight_sync``: bucketed broadcasts, verified by hash).

:class:`RolloutEngine` is the contract an external engine would implement (docs/scaling.md, "Rollout
engine interface"); :class:`RolloutWorker` is its first, in-process implementation.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import torch
from tensordict import TensorDict

from diffrl.distributed import controller, weight_sync
from diffrl.distributed.controller import Dispatch, WorkerGroup, register
from diffrl.distributed.ray import RayExecutor
from diffrl.distributed.workers import (
    ActorRolloutRefWorker,
    TrainingWorker,
    WorkerConfig,
)
from diffrl.engine.engine import compile_denoiser


class RolloutEngine(Protocol):
    """What the driver asks of a rollout engine (one replica).

    ``generate_sequences(request)``: ``request`` is a request batch (:func:`diffrl.sampling.request.sample_batch`:
    per-sample ``seeds [B]``, ``group_id [B]``, optionally ``init_seeds [B]``, non-tensor ``prompts`` and the typed
    :class:`~diffrl.sampling.request.SampleRequest`); it returns the trajectory TensorDict (``latents``, ``sigmas``,
    ``log_probs`` of the behaviour policy, ``sde_mask``, ``cond``, ``images``, ``group_id``, ``seeds``, ``prompts``,
    ``means`` when asked) plus ``weights_version [B]``. ``receive_weights(version, adapters, bucket_bytes)``
    joins the actor's broadcast and afterwards reports ``version`` and the hash of what it holds.
    ``sleep()`` frees the device (weights to host memory), ``wake()`` brings them back; requests and syncs
    need the engine awake.
    """

    weights_version: int

    def init_model(self) -> None: ...

    def generate_sequences(self, data: TensorDict) -> TensorDict: ...

    def init_weight_sync(self, backend: str, host: str, port: int, sync_rank: int, world_size: int, timeout_s: float) -> None: ...

    def receive_weights(self, version: int, adapters: list[str], bucket_bytes: int) -> dict: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class RolloutWorker(ActorRolloutRefWorker):
    """The rollout role alone: a model copy that samples and receives weights (the in-process :class:`RolloutEngine`).

    Args:
        config: the same :class:`WorkerConfig` as the actor's (model, LoRA, sampler, seed).
        role: ``rollout`` (the only role of this class).
    """

    def __init__(self, config: WorkerConfig, role: str = "rollout"):
        if role != "rollout":
            raise ValueError(f"RolloutWorker has the role 'rollout' only, got {role!r}")
        super().__init__(config, role="rollout")
        self.asleep = False

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the model; with LoRA attach the actor's adapters (same config and seed; the first sync
        overwrites them). The optimizer the engine builds with them is never stepped."""
        TrainingWorker.__init__(self, self.config)
        if self.engine.uses_lora:
            self.engine.initialize()
        else:
            # no reference copy and no optimizer (the replica only samples), but the actor's autograd flags: some CPU
            # kernels take another path when weights require grad, even under no_grad (with requires_grad off the
            # digits replica's log-probs were 1e-8 off the actor's re-scoring, which must match bit for bit)
            self.engine.module.requires_grad_(True)
            m = self.config.model
            if m.compile:
                blocks = self.adapter.fsdp_blocks() if m.compile_scope == "blocks" else None
                compile_denoiser(self.engine.module, backend=m.compile_backend, mode=m.compile_mode, cache_dir=m.compile_cache_dir, blocks=blocks)

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, data: TensorDict) -> TensorDict:
        """Sample as :meth:`ActorRolloutRefWorker.generate_sequences`, and tag each row with ``weights_version``."""
        if self.asleep:
            raise RuntimeError("the rollout replica is asleep: call wake() before generate_sequences")
        td = super().generate_sequences(data)
        td["weights_version"] = torch.full((td.shape[0],), self.weights_version, dtype=torch.long)
        return td

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_sync(self, backend: str, host: str, port: int, sync_rank: int, world_size: int, timeout_s: float) -> None:
        self.sync_channel = weight_sync.WeightSyncChannel(backend, host, port, sync_rank, world_size, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int, adapters: list[str], bucket_bytes: int) -> dict:
        """Join the actor's broadcast of weights ``version``; returns its sizes, time and the hash of what this replica now holds."""
        if self.sync_channel is None:
            raise RuntimeError("receive_weights before init_weight_sync")
        if self.asleep:
            raise RuntimeError("the rollout replica is asleep: call wake() before a weight sync")
        weight_sync.ensure_adapters(self.engine, adapters)
        stats = weight_sync.receive_weights(self.engine, self.sync_channel, bucket_bytes)
        self.weights_version = int(version)
        return {**stats, "version": self.weights_version}

    @register(Dispatch.ONE_TO_ALL)
    def weights_hash(self) -> str:
        """SHA-256 of the synced tensors (``weight_sync.state_hash``)."""
        return weight_sync.state_hash(weight_sync.sync_parameters(self.engine))

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self) -> None:
        """Move the model to host memory and release the device's cache (a no-op move on the CPU)."""
        self.engine.to("cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.asleep = True

    @register(Dispatch.ONE_TO_ALL)
    def wake(self) -> None:
        """Move the model back to ``model.device``."""
        self.engine.to(self.config.model.device)
        self.asleep = False


class Pending:
    """A request in flight on the replicas: its refs, one per replica, and when it was sent."""

    def __init__(self, refs: list, started: float):
        self.refs, self.started = refs, started


class RolloutReplicas:
    """``replicas`` rollout workers as Ray actors, fed by the driver, synced from the actor group.

    Args:
        config: the actors' :class:`WorkerConfig`.
        actors: the actor group (Ray executor: its rank 0 sends the weights, every rank gathers them).
        replicas: number of rollout replicas (each samples an equal share of every request).
        bucket_bytes: weight-sync bucket size.
        backend: weight-sync backend (None: nccl when the model is on CUDA, else gloo).
        num_cpus, num_gpus: Ray resources of each replica.
        threads, rendezvous_timeout_s, call_timeout_s: as for the actors.
    """

    def __init__(self, config: WorkerConfig, actors: WorkerGroup, *, replicas: int, bucket_bytes: int, backend: str | None = None,
                 num_cpus: float = 1.0, num_gpus: float = 0.0, threads: int | None = None, rendezvous_timeout_s: float = 300.0,
                 call_timeout_s: float | None = None):
        if not isinstance(actors.executor, RayExecutor):
            raise TypeError("distributed.rollout_replicas > 0 needs the actors on Ray (distributed.backend=ray)")
        self.actors = actors
        self.bucket_bytes = int(bucket_bytes)
        self.backend = backend or ("nccl" if torch.device(config.model.device).type == "cuda" else "gloo")
        # a replica is a world of one that samples whole videos: the actors' sequence parallelism is theirs alone
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, sequence_parallel=1))
        self.executor = RayExecutor(
            RolloutWorker, config, num_workers=replicas, role="rollout", num_cpus_per_worker=num_cpus, num_gpus_per_worker=num_gpus,
            threads=threads, rendezvous_timeout_s=rendezvous_timeout_s, call_timeout_s=call_timeout_s, process_group=False,
            keys=("distributed.rollout_replicas", "distributed.num_cpus_per_rollout"),
        )
        self.group = WorkerGroup(RolloutWorker, self.executor)
        self.replicas = replicas
        self.in_flight: list[Pending] = []
        try:
            self.group.init_model()
            host, port = actors.executor.node_address(0)
            world = 1 + replicas
            actor_refs = actors.executor.submit("init_weight_sync", [(self.backend, host, port, world, rendezvous_timeout_s)] * actors.world_size, {})
            replica_refs = self.executor.submit(
                "init_weight_sync", [(self.backend, host, port, 1 + r, world, rendezvous_timeout_s) for r in range(replicas)], {},
            )
            actors.executor.collect(actor_refs, "the weight-sync rendezvous (actors)")
            self.executor.collect(replica_refs, "the weight-sync rendezvous (rollout replicas)")
        except BaseException:
            self.executor.shutdown()
            raise

    # -- rollouts ----------------------------------------------------------------------------------
    def submit(self, request: TensorDict) -> Pending:
        """Send ``request`` (split over the replicas) without waiting; each replica runs its calls in order."""
        chunks = controller.split_for_dp(request, self.replicas)
        pending = Pending(self.executor.submit("generate_sequences", [(c,) for c in chunks], {}), time.perf_counter())
        self.in_flight.append(pending)
        return pending

    def collect(self, pending: Pending) -> TensorDict:
        """The trajectories of a submitted request, concatenated in request order."""
        out = controller.gather_dp(self.executor.collect(pending.refs, "rollout replica call generate_sequences"))
        self.in_flight = [p for p in self.in_flight if p is not pending]
        return out

    def generate_sequences(self, request: TensorDict) -> TensorDict:
        return self.collect(self.submit(request))

    def drain(self) -> float:
        """Wait until the requests in flight are sampled (their results stay to be collected); returns the seconds waited."""
        import ray

        start = time.perf_counter()
        refs = [ref for p in self.in_flight for ref in p.refs]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.executor.call_timeout_s)
        return time.perf_counter() - start

    def discard(self) -> None:
        """Forget the requests in flight (a restart or resume refills the queue)."""
        self.in_flight = []

    # -- weights -------------------------------------------------------------------------------------
    def sync(self, version: int) -> dict:
        """Push the actor's weights (version ``version``) to every replica and check them bit for bit.

        Waits first for the requests in flight (a replica runs its calls in order, so the broadcast would
        otherwise wait inside the collective). Returns the step-record entries: ``time/weight_sync`` (the
        replicas' transfer and copy, slowest replica), ``time/weight_sync_wait`` (rollouts in flight),
        ``time/weight_sync_total``, ``weight_sync/bytes``, ``weight_sync/buckets``, ``weight_sync/hash``
        (the first 16 hex digits of SHA-256, equal on the actor and every replica).

        Raises:
            RuntimeError: a replica's weights differ from the actor's after the sync.
        """
        start = time.perf_counter()
        waited = self.drain()
        adapters = self.actors.executor.collect(self.actors.executor.submit("sync_adapters", [()] * self.actors.world_size, {}), "sync_adapters")[0]
        actor_refs = self.actors.executor.submit("send_weights", [(version, self.bucket_bytes)] * self.actors.world_size, {})
        replica_refs = self.executor.submit("receive_weights", [(version, adapters, self.bucket_bytes)] * self.replicas, {})
        sent = self.actors.executor.collect(actor_refs, "weight sync (actors)")[0]
        received = self.executor.collect(replica_refs, "weight sync (rollout replicas)")
        for r, got in enumerate(received):
            if got["digest"] != sent["digest"]:
                raise RuntimeError(f"rollout replica {r} holds other tensors than the actor (names/shapes/dtypes differ); the model configs differ")
            if got["hash"] != sent["hash"]:
                raise RuntimeError(f"rollout replica {r}'s weights differ from the actor's after the sync of version {version} "
                                   f"(hash {got['hash'][:16]} vs {sent['hash'][:16]})")
        return {
            "time/weight_sync": max(got["seconds"] for got in received), "time/weight_sync_wait": waited,
            "time/weight_sync_total": time.perf_counter() - start, "weight_sync/bytes": sent["bytes"], "weight_sync/buckets": sent["buckets"],
            "weight_sync/hash": sent["hash"][:16], "weight_sync/hash_replicas": [got["hash"][:16] for got in received],
        }

    def shutdown(self) -> None:
        self.in_flight = []
        self.executor.shutdown()
