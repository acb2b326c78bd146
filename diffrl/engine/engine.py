"""Training and inference of the policy on one rank: micro-batches, gradient accumulation, optimizer.

The engine owns the model adapter (its ``denoiser`` carries the LoRA adapters) and the optimizer.
Both paths call the adapter's ``predict()`` and the sampler step of ``diffrl.sampling.sde`` with the recorded
``prev_sample``, exactly as the rollout did, so recomputed log-probs equal the rollout's at equal batch
composition.

The loss is an :class:`~diffrl.engine.objective.Objective` (``diffrl.engine.objective``), and the engine reads only
its declared ``spec``: a per-step objective is called as ``objective(step, batch, k) -> (loss, metrics)`` where ``step``
holds ``log_prob``, ``mean``, ``std`` of the current policy at step ``k`` and, when ``spec.reference`` names one,
``ref_mean`` and ``ref_log_prob`` of that reference policy (:meth:`DiffusionEngine.reference_policy`: the base model,
an adapter such as ``old``, GARDO's adaptive reference, or a frozen teacher model, :meth:`DiffusionEngine.teacher`); a
micro-batch objective yields its own pieces; an objective with ``spec.prepares_batch`` sees the whole batch first. A plain
per-step function is a step objective with no reference.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections import defaultdict
from pathlib import Path

import torch
from tensordict import TensorDict

from diffrl.config import ModelConfig, OptimConfig, SamplerConfig
from diffrl.engine import fp8, lora, memory, parallel, precision, sequence_parallel
from diffrl.engine.objective import Granularity, Objective, Reference, as_objective
from diffrl.sampling.sde import is_deterministic, run_step
from pipelines import build_adapter


def lr_factor(step: int, o: OptimConfig, total_steps: int | None = None) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based): linear warm-up over
    ``o.warmup_steps``, then ``o.lr_schedule`` (constant, or linear / cosine decay to 0 at ``total_steps``)."""
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.lr_schedule == "constant":
        return 1.0
    if o.lr_schedule not in ("linear", "cosine"):
        raise ValueError(f"unknown lr schedule {o.lr_schedule!r}; choose constant, linear or cosine")
    if not total_steps:
        raise ValueError(f"lr schedule {o.lr_schedule!r} needs the total number of optimizer steps")
    progress = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
    return 1.0 - progress if o.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def compile_denoiser(module: torch.nn.Module, *, backend: str = "inductor", mode: str | None = None, cache_dir: str | None = None,
                     blocks: list[torch.nn.Module] | None = None) -> None:
    """Compile ``module`` in place with ``torch.compile`` (``nn.Module.compile``: parameters, buffers and
    state-dict keys stay those of the module, unlike a wrapping ``OptimizedModule``).

    Shapes are static (``dynamic=False``): each batch shape gets its own graph (a rollout's CFG batch and a
    training micro-batch are usually the same), which keeps the kernels shape-specialised and fast. Switching
    LoRA adapters or disabling them (the reference policy) re-specialises on those flags once each; the
    recompile limit is raised to 32 so that these variants (train/eval mode × grad × adapter state × batch
    shapes) do not silently fall back to eager. Under FSDP2 the sharded module is compiled (not yet measured).
    Sets inductor's ``emulate_precision_casts`` (process-wide) for rollout/training log-prob parity.

    ``mode`` is ``torch.compile``'s (``default``; ``reduce-overhead`` replays CUDA graphs, which removes the
    launch gaps of the rollout's step loop, and here applies to gradient-free calls only (:class:`GradModeDispatch`);
    ``max-autotune``). ``cache_dir`` becomes inductor's cache
    directory (``TORCHINDUCTOR_CACHE_DIR``, process-wide, kernels and FX graphs), so that a restarted run
    finds its compiled graphs there instead of compiling again.

    ``blocks`` (``model.compile_scope=blocks``): compile each of these repeated blocks in place instead of the
    whole module (regional compilation). Identical blocks share one graph (parameters are graph inputs), so
    compile time no longer grows with depth; the code between blocks stays eager.
    """
    targets = list(blocks) if blocks else [module]
    if all(getattr(t, "_compiled_call_impl", None) is not None for t in targets):
        return
    import torch._inductor.config as inductor_config

    # round fused intermediates to the low precision where eager would: the no-grad (rollout) and the
    # training graph fuse differently, and without this their bf16 log-probs drift apart. Measured on the
    # SD3.5-M benchmark (benchmarks/RESULTS.md): max |Δlogp| 3.9e-3 → 2.6e-4, rollout speed unchanged.
    if hasattr(inductor_config, "emulate_precision_casts"):
        inductor_config.emulate_precision_casts = True
    dynamo_config = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 32))
    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir).resolve())
    for target in targets:
        if mode == "reduce-overhead":
            # CUDA graphs where they pay: gradient-free calls (the rollout's step loop, reference and old-policy
            # scoring) replay graphs; training forwards run default-mode graphs, since graph trees re-record across
            # micro-batches and made the SD3.5-M update 9× slower (benchmarks/RESULTS.md)
            target._compiled_call_impl = GradModeDispatch(
                graphs=torch.compile(target._call_impl, backend=backend, dynamic=False, mode=mode),
                plain=torch.compile(target._call_impl, backend=backend, dynamic=False),
            )
        else:
            target.compile(backend=backend, dynamic=False, mode=None if mode in (None, "default") else mode)


STEP_EDGES = ("latents", "sigmas")
"""trajectory keys ``[B, K+1, …]``: step ``k`` reads entries ``k`` and ``k + 1``"""
STEP_ENTRIES = ("log_probs", "sde_mask", "means", "prox_log_probs")
"""trajectory keys ``[B, K, …]``: step ``k`` reads entry ``k``"""


class GradModeDispatch:
    """A module's compiled call that runs ``graphs`` without gradients and ``plain`` with them."""

    def __init__(self, graphs, plain):
        self.graphs, self.plain = graphs, plain

    def __call__(self, *args, **kwargs):
        return (self.plain if torch.is_grad_enabled() else self.graphs)(*args, **kwargs)


class DiffusionEngine:
    """Policy training/inference for one model adapter on one device.

    Args:
        adapter: a ``pipelines.base.ModelAdapter``.
        model: LoRA, FSDP2, activation checkpointing and compile settings (``model.*``).
        optim: the optimizer and its schedule (``algorithm.lr`` …).
        sampler: the sampler the trajectories were drawn with (step kind, noise level, CFG).
        micro_batch_size: trajectories per forward/backward (None: the whole mini-batch).
        seed: seed of the LoRA initialisation (independent of the global RNG, so runs reproduce).
        old_policy: create the ``old`` policy (a copy of the trained one) at initialisation, before sharding.
        total_steps: optimizer steps of the whole run (linear and cosine schedules need it).
    """

    def __init__(self, adapter, *, model: ModelConfig, optim: OptimConfig, sampler: SamplerConfig, micro_batch_size: int | None = None,
                 seed: int = 0, old_policy: bool = False, total_steps: int | None = None):
        self.adapter = adapter
        self.model = model
        self.optim = optim
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.old_policy_at_start = old_policy
        self.total_steps = total_steps
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._reference_copy = None
        self._old_copy = None
        self._teachers: dict[str, object] = {}
        self._teacher_cond: tuple | None = None  # (source, prompts, cond) of the last micro-batch the teacher encoded
        self.master_weights: precision.MasterWeights | None = None
        self.sharded = False
        self._fused = None
        self.gradient_scale = 1.0
        self.initialized = False

    # -- set-up -----------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.adapter.denoiser

    @property
    def uses_lora(self) -> bool:
        return self.model.lora.rank > 0

    def initialize(self) -> None:
        """Attach LoRA (or unfreeze everything) and build the optimizer; idempotent."""
        if self.initialized:
            return
        module = self.module
        if not self.uses_lora:  # before any work: every parameter will train
            precision.check_supported(list(module.named_parameters()), lora=False)
        module.requires_grad_(False)
        if self.uses_lora:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                lo = self.model.lora
                lora.attach_lora(
                    module, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=lora.lora_targets(self.adapter, lo.target_modules, lo.experts),
                )
            for p in lora.adapter_parameters(module, "default").values():
                p.requires_grad_(True)
            precision.check_supported(list(lora.adapter_parameters(module, "default").items()), lora=True)
        else:
            # the reference of full fine-tuning is a frozen copy of the initial weights
            self._reference_copy = copy.copy(self.adapter)
            self._reference_copy.denoiser = copy.deepcopy(module).requires_grad_(False)
            module.requires_grad_(True)
        if self.model.activation_checkpointing:
            memory.checkpoint_blocks(self.adapter.fsdp_blocks(), self.model.checkpoint_every)
        self.initialized = True  # copy_to_old below must not re-enter
        if self.old_policy_at_start:
            self.copy_to_old()
        if self.model.sequence_parallel > 1:
            self._apply_sequence_parallel()
        masters = precision.MasterWeights.needed(self._named_trainable())
        if self.model.fsdp and parallel.world_size() > 1:
            # bf16 full fine-tuning: gradients reduce-scattered in fp32 (the compute weights stay the bf16 shards)
            parallel.apply_fsdp(module, self.adapter.fsdp_blocks(), param_offload=self.model.param_offload,
                                reduce_dtype=precision.MASTER_DTYPE if masters else None)
            if self._reference_copy is not None:  # full fine-tuning's frozen reference: sharded too (1/N a rank, gathered a block at a time)
                parallel.apply_fsdp(self._reference_copy.denoiser, self._reference_copy.fsdp_blocks(), param_offload=self.model.param_offload)
            self.sharded = True
        if self.model.fuse_lora_rollout:
            if not self.uses_lora:
                raise ValueError("model.fuse_lora_rollout=true needs a LoRA adapter (model.lora.rank > 0); full fine-tuning has nothing to fuse")
            self._fused = lora.FusedWeights(module)  # sharded actor ranks may hold it; they must not sample (rollout_weights)
        if self.model.compile:
            blocks = self.adapter.fsdp_blocks() if self.model.compile_scope == "blocks" else None
            compile_denoiser(module, backend=self.model.compile_backend, mode=self.model.compile_mode, cache_dir=self.model.compile_cache_dir, blocks=blocks)
            if self.model.compile_vae:
                self.adapter.compile_decoder(backend=self.model.compile_backend)
            # CUDA graphs: one graph-tree step per prediction (both CFG branches, every block), see ModelAdapter.predict
            self.adapter.cudagraph_steps = self.model.compile_mode == "reduce-overhead"
        o, total = self.optim, self.total_steps
        stepped = self.trainable_parameters()
        if masters:  # fp32 masters of the (sharded) bf16 weights are what AdamW steps (diffrl.engine.precision)
            self.master_weights = precision.MasterWeights(self._named_trainable())
            stepped = self.master_weights.stepped
        self.optimizer = torch.optim.AdamW(stepped, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        lr_factor(0, o, total)  # validate the schedule before any work
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, o, total))
        self.initialized = True

    def _apply_sequence_parallel(self) -> None:
        """Split each sample's video tokens over groups of ``model.sequence_parallel`` ranks (:mod:`diffrl.engine.sequence_parallel`)
        in every transformer the family names (``adapter.sequence_parallel_transformers()``). A rank's gradients are its
        tokens' share and FSDP2 averages over all ranks, so backwards are scaled by the group size: the update is the
        data-parallel mean of the groups' sums, as with whole samples per rank."""
        k = int(self.model.sequence_parallel)
        transformers = getattr(self.adapter, "sequence_parallel_transformers", None)
        if transformers is None:
            raise ValueError(f"model.sequence_parallel={k} splits video tokens; model family {getattr(self.adapter, 'family', type(self.adapter).__name__)!r} has no sequence-parallel "
                             "transformer (video families: wan, wan22)")
        if not (self.model.fsdp and parallel.world_size() > 1):
            raise ValueError(f"model.sequence_parallel={k} needs {k}·n ranks sharded with FSDP2 (distributed.backend=ray, distributed.num_workers "
                             f"a multiple of {k}, model.fsdp=true); this process is one of {parallel.world_size()}")
        group = sequence_parallel.new_groups(k)
        for transformer in transformers():
            sequence_parallel.apply_wan(transformer, group)
        self.gradient_scale = float(k)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The module's trainable parameters (with fp32 masters: the bf16 working copy, not what the optimizer steps)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def _named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def stepped_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: the fp32 masters of bf16 weights (``master_weights``), else the trainable parameters."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def master_state(self) -> dict[str, torch.Tensor]:
        """Name → fp32 master of each bf16 trainable weight (DTensor shards under FSDP2); empty without masters."""
        return self.master_weights.state() if self.master_weights is not None else {}

    def load_master_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the masters from whole tensors (a checkpoint's trainable weights) and round them into the module."""
        if self.master_weights is not None:
            self.master_weights.load_state(state)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name → whole tensor of every trainable parameter (the LoRA "default" adapter, or all weights);
        under FSDP2 a collective that every rank must call."""
        return {n: parallel.full_tensor(p.detach()) for n, p in self.module.named_parameters() if p.requires_grad}

    def rollout_weights(self, low_precision: bool = True):
        """Context for gradient-free sampling: with ``model.fuse_lora_rollout`` the active LoRA adapter folded into the
        base weights (:class:`diffrl.engine.lora.FusedWeights`); then, with ``model.rollout_precision=fp8`` and
        ``low_precision`` (rollouts, not evaluations), the linear layers in FP8 (:func:`diffrl.engine.fp8.fp8_linears`).
        FSDP2-sharded weights cannot be fused: sharded actor ranks sample unfused (with rollout replicas they only
        evaluate; without replicas the trainer refuses the setting before any work, ``recipes.check_sizes``)."""
        self.initialize()
        low = low_precision and self.model.rollout_precision == "fp8"
        if low and self.sharded:
            raise ValueError("model.rollout_precision=fp8 quantises whole weights; sharded (FSDP2) actor ranks cannot sample in FP8: "
                             "use rollout replicas (distributed.rollout_replicas ≥ 1) or distributed.num_workers=1")
        return self._rollout_context(low)

    @contextlib.contextmanager
    def _rollout_context(self, low_precision: bool):
        with contextlib.ExitStack() as stack:  # entered by the caller's with-statement (inside its no_grad)
            if self._fused is not None and not self.sharded:
                stack.enter_context(self._fused.fused())
            if low_precision:
                # CUDA graphs replay on fixed addresses: only then the FP8 copy stays allocated between rollouts
                stack.enter_context(fp8.fp8_linears(self.module, self.model.rollout_fp8_kernel, keep_buffers=self.model.compile_mode == "reduce-overhead"))
            yield

    @contextlib.contextmanager
    def reference(self):
        """Yield the model adapter running as the reference policy (LoRA disabled; full FT: frozen copy)."""
        if self.uses_lora:
            with lora.adapters_disabled(self.module):
                yield self.adapter
            return
        yield self._reference_copy

    @contextlib.contextmanager
    def reference_policy(self, reference: Reference):
        """Yield the model adapter running as an objective's declared ``reference``: ``base`` (:meth:`reference`) or the
        adapter it names (``old``: :meth:`old_policy`; another: that LoRA adapter, which must exist)."""
        if reference.kind == "base":
            with self.reference() as adapter:
                yield adapter
        elif reference.kind == "adapter" and reference.adapter == "old":
            with self.old_policy() as adapter:
                yield adapter
        elif reference.kind == "adapter":
            if not self.uses_lora or reference.adapter not in getattr(self.module, "peft_config", {}):
                raise ValueError(f"the objective's reference is the LoRA adapter {reference.adapter!r}, which this model does not have")
            with lora.adapter_active(self.module, reference.adapter):
                yield self.adapter
        elif reference.kind == "teacher":
            yield self.teacher(reference.source)
        else:
            raise ValueError(f"unknown reference kind {reference.kind!r}; choose one of {Reference.KINDS}")

    def teacher(self, source: str):
        """The frozen teacher model of ``source`` (a local folder or a Hub id of this engine's family), loaded once by
        the family's loader (``pipelines.build_adapter``) with the student's ``model.options``, in the engine's compute
        dtype (``model.dtype``) on its device, in eval mode with every parameter frozen (no gradient ever reaches it).
        Not sharded or compiled: each rank holds a whole copy.

        Raises:
            FileNotFoundError / ValueError: the family's loader's one-line error naming the missing folder or file.
        """
        if source not in self._teachers:
            kwargs = {**self.model.adapter_kwargs(), "path": source, "revision": None}
            teacher = build_adapter(self.model.family, **kwargs)
            for module in (teacher.denoiser, getattr(teacher, "text_encoder", None)):
                if isinstance(module, torch.nn.Module):
                    module.eval().requires_grad_(False)
            self._teachers[source] = teacher
        return self._teachers[source]

    def reference_cond(self, reference: Reference | None, batch: TensorDict) -> TensorDict:
        """The conditioning ``reference`` reads for ``batch``'s rows: the recorded ``batch["cond"]``, or for a ``teacher``
        the batch's prompts (non-tensor ``prompts``) encoded by the teacher's own text encoder, one prompt per call as the
        rollout encodes them (so a teacher whose weights equal the student's gets the recorded conditioning exactly)."""
        if reference is None or reference.kind != "teacher":
            return batch["cond"]
        if "prompts" not in batch.keys():
            raise ValueError(f"the reference is {reference}: it encodes the prompts itself, but the batch carries no 'prompts'")
        prompts = [str(p) for p in batch.get("prompts").tolist()]
        cached = self._teacher_cond
        if cached is None or cached[0] != reference.source or cached[1] != prompts:
            teacher = self.teacher(reference.source)
            if getattr(teacher, "editing", False):
                raise ValueError(f"a teacher of an editing family ({type(teacher).__name__}) needs the source images, which this engine does not pass; "
                                 "use a text-to-image family")
            unique = list(dict.fromkeys(prompts))
            with torch.no_grad():
                encoded = torch.cat([teacher.encode([p]) for p in unique])
            cond = encoded[torch.tensor([unique.index(p) for p in prompts])]
            self._teacher_cond = cached = (reference.source, prompts, cond)
        return cached[2]

    # -- the old policy (DiffusionNFT's sampling policy) -----------------------------------------
    @property
    def has_old(self) -> bool:
        return "old" in getattr(self.module, "peft_config", {}) if self.uses_lora else self._old_copy is not None

    def copy_to_old(self) -> None:
        """old ← current (LoRA: the ``old`` adapter; full fine-tuning: a frozen copy of the denoiser)."""
        self.ema_to_old(0.0)

    def ema_to_old(self, decay: float) -> None:
        """old ← decay·old + (1 − decay)·current; creates old as a copy of current the first time."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.initialize()
        if self.uses_lora:  # a missing "old" adapter is created as a copy
            lora.ema_update_adapter(self.module, "default", "old", decay)
            return
        if self._old_copy is None:
            if self.sharded:
                raise ValueError("an old policy for full fine-tuning under FSDP2 is not supported; train a LoRA (model.lora.rank > 0)")
            self._old_copy = copy.copy(self.adapter)
            self._old_copy.denoiser = copy.deepcopy(self.module).requires_grad_(False)
            return
        with torch.no_grad():
            for p_old, p in zip(self._old_copy.denoiser.parameters(), self.module.parameters()):
                p_old.mul_(decay).add_(p.detach(), alpha=1.0 - decay)

    @contextlib.contextmanager
    def old_policy(self):
        """Yield the model adapter running as the old policy (created as a copy of current if missing)."""
        if not self.has_old:
            self.copy_to_old()
        if self.uses_lora:
            with lora.adapter_active(self.module, "old"):
                yield self.adapter
            return
        yield self._old_copy

    @contextlib.contextmanager
    def policy(self, name: str):
        """Yield the model adapter running as policy ``name``: ``current`` (the trained weights), ``old`` (DiffusionNFT's
        sampling policy, :meth:`old_policy`) or ``ema`` (the evaluated EMA of ``eval.ema``, a LoRA adapter)."""
        if name == "current":
            yield self.adapter
        elif name == "old":
            with self.old_policy() as adapter:
                yield adapter
        elif name == "ema":
            if not self.uses_lora or "ema" not in getattr(self.module, "peft_config", {}):
                raise ValueError("policy 'ema' needs the LoRA adapter 'ema' (eval.ema=true with model.lora.rank > 0); this model has none")
            with lora.adapter_active(self.module, "ema"):
                yield self.adapter
        else:
            raise ValueError(f"unknown policy {name!r}; choose current, old or ema")

    def old_state(self) -> dict[str, torch.Tensor]:
        """The old policy's weights that the module's own parameters do not hold (full fine-tuning)."""
        if self.uses_lora or self._old_copy is None:
            return {}
        return {n: p.detach() for n, p in self._old_copy.denoiser.named_parameters()}

    def load_old_state(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        self.copy_to_old()
        params = dict(self._old_copy.denoiser.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def to(self, device: str) -> None:
        self.module.to(device)
        if self.master_weights is not None:
            self.master_weights.to(device, self.optimizer)
        if hasattr(self.adapter, "text_encoder"):
            self.adapter.text_encoder.to(device)
        for teacher in self._teachers.values():  # frozen teachers follow the policy
            teacher.denoiser.to(device)
            if hasattr(teacher, "text_encoder"):
                teacher.text_encoder.to(device)
        self._teacher_cond = None

    # -- per-step scoring -----------------------------------------------------------------------
    def _score_step(self, adapter, batch: TensorDict, k: int, cond: TensorDict | None = None):
        """Step ``k`` of ``batch`` under ``adapter``: the SDE step scoring the recorded next latent (``cond``: another
        conditioning than the recorded ``batch["cond"]``, a teacher's)."""
        device = self.adapter.device
        latents = batch["latents"]
        x = latents[:, k].to(device)
        x_next = latents[:, k + 1].to(device)
        sigma = batch["sigmas"][:, k].to(device)
        sigma_next = batch["sigmas"][:, k + 1].to(device)
        out = adapter.predict(x, sigma, (batch["cond"] if cond is None else cond).to(device), self.sampler.guidance_scale)
        return run_step(
            self.sampler.kind, out, x, sigma, sigma_next, noise_level=self.sampler.noise_level,
            prediction_type=getattr(self.adapter, "prediction_type", "flow"), prev_sample=x_next, clip_sample=self.sampler.clip_sample,
        )

    def _trained_steps(self, batch: TensorDict) -> list[int]:
        mask = batch["sde_mask"]
        if is_deterministic(self.sampler.kind, self.sampler.noise_level):
            raise ValueError(
                f"step kind {self.sampler.kind!r} (noise_level {self.sampler.noise_level}) is deterministic: "
                "it has no log-prob to train on; use a stochastic kind (flow_sde, dance_sde, cps, ddim with η > 0)"
            )
        if not bool((mask == mask[:1]).all()):
            raise ValueError("trajectories of one mini-batch must share the same sde_mask")
        return [k for k in range(mask.shape[1]) if bool(mask[0, k])]

    def _micro_batches(self, batch: TensorDict) -> list[TensorDict]:
        size = self.micro_batch_size or batch.shape[0]
        return [batch[i : i + size] for i in range(0, batch.shape[0], size)]

    # -- train / infer ----------------------------------------------------------------------------
    def train_batch(self, batch: TensorDict, loss_fn: Objective, *, seed: int = 0) -> dict:
        """One optimizer step on ``batch``, gradient accumulated over micro-batches.

        ``loss_fn`` is an :class:`~diffrl.engine.objective.Objective` (or a plain per-step function); its ``spec`` says
        how it is run. Per-step objectives run over the trajectories × their trained steps; micro-batch objectives (NFT,
        DPO, AWM, DGPO) yield their own pieces. Each piece's loss is weighted by its share of the batch, so the update
        equals the mean over all rows whatever the micro-batch size. ``seed`` seeds the noise of objectives that draw it
        (with each sample's seed). With ``spec.prepares_batch`` the objective's ``prepare_batch(engine, batch, seed) ->
        batch`` sees the whole batch first, gradient-free (e.g. DGPO's group weights, which need every member of a group
        before any micro-batch's gradient).
        """
        if loss_fn is None:
            raise RuntimeError("no loss function set: call set_loss_fn first")
        objective = as_objective(loss_fn)
        self.initialize()
        if objective.spec.prepares_batch:
            with torch.no_grad():
                batch = objective.prepare_batch(self, batch, seed)
        self.module.train()
        sums: dict[str, float] = defaultdict(float)
        loss_total = 0.0
        for micro in self._micro_batches(batch):
            micro = micro.to(self.adapter.device)
            share = micro.shape[0] / batch.shape[0]
            for loss, weight, metrics in self._pieces(objective, micro, seed):
                if loss.requires_grad or not self.model.lora.experts:  # LoRA on some experts: a step of another reaches no trained parameter
                    (loss * share * weight * self.gradient_scale).backward()  # × 1.0 is exact
                loss_total += loss.item() * share * weight
                for name, value in metrics.items():
                    sums[name] += value * share * weight
        grad_norm, skipped = self._optimizer_step(loss_total)
        return {"loss": loss_total, "metrics": {**sums, "grad_norm": grad_norm, "skipped_nonfinite": float(skipped), "lr": self.optimizer.param_groups[0]["lr"]}}

    def _pieces(self, loss_fn: Objective, micro: TensorDict, seed: int):
        objective = as_objective(loss_fn)
        if objective.spec.granularity is Granularity.MICRO_BATCH:
            yield from objective.micro_losses(self, micro, seed)
            return
        if not bool((micro["sde_mask"] == micro["sde_mask"][:1]).all()):
            yield from self._per_row_step_pieces(objective, micro)
            return
        steps = self._trained_steps(micro)
        for k in steps:
            loss, metrics = objective(self._step_outputs(objective, micro, k), micro, k)
            yield loss, 1.0 / len(steps), metrics

    def _step_outputs(self, objective: Objective, batch: TensorDict, k: int) -> dict:
        """What a per-step objective reads of step ``k``: the current policy's ``log_prob``, ``mean``, ``std`` and, when
        its spec names a reference, that reference's ``ref_mean`` and ``ref_log_prob`` (no gradient)."""
        out = self._score_step(self.adapter, batch, k)
        step_out = {"log_prob": out.log_prob, "mean": out.mean, "std": out.std}
        reference = objective.spec.reference
        if reference is not None:
            with torch.no_grad(), self.reference_policy(reference) as ref:
                cond = self.reference_cond(reference, batch) if reference.kind == "teacher" else None
                ref_out = self._score_step(ref, batch, k, cond)
            step_out.update(ref_mean=ref_out.mean, ref_log_prob=ref_out.log_prob)
        return step_out

    def _per_row_step_pieces(self, objective: Objective, micro: TensorDict):
        """Per-step losses of a micro-batch whose rows train different steps (``sde_mask [B, K]`` by row: DanceGRPO's
        per-sample choice, ``sampler.window=random_per_sample``). Every row trains the same number ``n`` of steps; piece
        ``j`` scores each row at its own ``j``-th trained step (the rows' step tensors gathered into a one-step batch), so
        every micro-batch makes ``n`` forwards of all its rows whatever its rows chose (the same collectives on every
        FSDP rank), and the update is the mean over rows of each row's mean over its own steps."""
        mask = micro["sde_mask"].bool()
        per_row = mask.sum(1)
        if int(per_row.min()) < 1 or not bool((per_row == per_row[0]).all()):
            raise ValueError(f"rows that train different steps must each train the same number of them (≥ 1), got {per_row.tolist()}")
        self._trained_steps(micro[:1])  # a deterministic step kind has nothing to train
        n = int(per_row[0])
        steps = torch.stack([row.nonzero().squeeze(1) for row in mask])  # [B, n] each row's trained steps, ascending
        rows = torch.arange(micro.shape[0], device=steps.device)
        keys = set(micro.keys())
        for j in range(n):
            k = steps[:, j]
            step = micro.exclude(*[key for key in (*STEP_EDGES, *STEP_ENTRIES) if key in keys])
            for key in STEP_EDGES:
                if key in keys:
                    step.set(key, torch.stack([micro[key][rows, k], micro[key][rows, k + 1]], 1))
            for key in STEP_ENTRIES:
                if key in keys:
                    step.set(key, micro[key][rows, k].unsqueeze(1))
            loss, metrics = objective(self._step_outputs(objective, step, 0), step, 0)
            yield loss, 1.0 / n, metrics

    def _optimizer_step(self, loss: float) -> tuple[float, bool]:
        """Clip and step; ``(grad norm, skipped)``. A non-finite loss or gradient norm (the same on every rank:
        the norm is global) never reaches the optimizer: the gradients are dropped, and the step is skipped
        (``optim.nonfinite=skip``, weights, optimizer and schedule unchanged) or raises ``FloatingPointError``
        (``stop``). With fp32 master weights the bf16 gradients are first moved into the masters', and the norm,
        clipping and check run on those; the stepped masters are then rounded into the bf16 weights."""
        if self.master_weights is not None:
            self.master_weights.collect_grads()
        params = self.stepped_parameters()
        max_norm = self.optim.max_grad_norm
        if max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        grad_norm = parallel.full_tensor(grad_norm)
        if not (torch.isfinite(grad_norm) and math.isfinite(loss)):
            self.optimizer.zero_grad(set_to_none=True)
            if self.master_weights is not None:
                self.master_weights.drop_grads()
            if self.optim.nonfinite == "stop":
                raise FloatingPointError(f"non-finite loss {loss} or gradient norm {grad_norm.item()} (algorithm.nonfinite=stop); the update was not applied")
            return float(grad_norm), True
        self.optimizer.step()
        if self.master_weights is not None:
            self.master_weights.write_back()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), False

    @torch.no_grad()
    def infer_batch(self, batch: TensorDict, *, reference: bool = False) -> TensorDict:
        """Recompute ``log_probs [B, K]`` of the recorded trajectories (0 at ODE steps).

        With ``reference=True`` the reference policy (adapters disabled) scores them.
        """
        self.initialize()
        self.module.eval()
        steps = self._trained_steps(batch)
        pieces = []
        ctx = self.reference() if reference else contextlib.nullcontext(self.adapter)
        with ctx as adapter:
            for micro in self._micro_batches(batch):
                lp = torch.zeros(micro.shape[0], batch["sde_mask"].shape[1])
                for k in steps:
                    lp[:, k] = self._score_step(adapter, micro, k).log_prob.float().cpu()
                pieces.append(lp)
        return TensorDict({"log_probs": torch.cat(pieces)}, batch_size=batch.batch_size)
