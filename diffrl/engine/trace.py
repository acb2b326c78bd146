"""Run diffrl's own rollout and training code at a published shape without allocating: fake tensors, live
bytes and executed FLOPs (the engine of ``diffrl plan``).

:class:`ShapeTrace` is a ``TorchDispatchMode`` entered inside torch's ``FakeTensorMode``. Every op runs as it
would on the GPU, on fake tensors that carry shapes, dtypes and strides but no data, so a 20 B model is built
and stepped on a laptop's CPU in seconds. Two things torch's tools do not give, and why this module exists:

* **Small tensors stay real.** Sampling code reads a few values back (a mask's ``.any()``, the number of valid
  text tokens, a window's start); on fake tensors that raises ``DataDependentOutputException``. Here an op
  whose tensor inputs are all real and small (≤ :data:`SMALL` elements: masks, seeds, schedules, token ids)
  runs for real, and its small outputs stay real; a small real tensor meeting a fake one becomes a fake
  *constant* (torch's constant propagation then keeps e.g. a boolean index exact). Big tensors are fake.
  Values read from fake tensors (a loss's ``.item()`` for the metrics) read as 0.
* **Live bytes of every storage, in every grad mode.** ``torch.distributed._tools.mem_tracker.MemTracker``
  attributes memory to modules through module hooks, and fails when a module runs under ``no_grad`` inside
  the tracked region (the rollout, the reference and old-policy passes, CFG's unconditional branch); the
  caching allocator's view is what a plan needs anyway. Each new storage is counted once at its size
  rounded up to CUDA's 512-byte allocation unit, and subtracted when Python frees it (a weak reference's
  callback), so ``current`` and ``peak`` follow ``torch.cuda.memory_allocated`` / ``max_memory_allocated``.

FLOPs are counted per op with ``torch.utils.flop_counter``'s formulas (``FlopCounterMode``'s module hooks
keep activations alive, which would defeat activation checkpointing), so they are the FLOPs the code runs:
the recompute of checkpointed blocks included, frozen weights computing no weight gradients.

Repeated gradient-free denoiser calls (the rollout's steps, the reference and old-policy passes) have the
same memory profile and FLOPs as the first call of the same shapes: :func:`memoised_forward` traces the first
and replays its transient peak and FLOPs for the rest, which makes a 10-step rollout cost one step's trace.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch
import torch._subclasses.fake_tensor as fake_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

SMALL = 1 << 16
"""elements up to which a tensor whose inputs are all real is computed for real (masks, seeds, schedules)"""
ALLOCATION_UNIT = 512
"""bytes: CUDA's caching allocator rounds every block up to a multiple of this"""
# ops whose output may be far larger than their inputs: their output size is checked on fake tensors first
_GROWING = {"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "repeat", "repeat_interleave", "empty_like", "zeros_like",
            "ones_like", "full_like", "rand_like", "randn_like", "expand_copy", "tile"}
_aten = torch.ops.aten


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def is_fake(t) -> bool:
    return isinstance(t, fake_tensor.FakeTensor)


class ShapeTrace(TorchDispatchMode):
    """Live bytes, their peak and the executed FLOPs of everything run inside it (see the module docstring).

    Use :func:`shape_trace` to enter it together with its ``FakeTensorMode``."""

    def __init__(self, fake_mode: fake_tensor.FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        self._seen = WeakIdKeyDictionary()
        self.current = 0
        self.peak = 0
        self.flops = 0
        self.phases: dict[str, dict] = {}

    # -- accounting ----------------------------------------------------------------------------------
    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        nbytes = -(-storage.nbytes() // ALLOCATION_UNIT) * ALLOCATION_UNIT
        self._seen[storage] = True
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, nbytes)

    def bump(self, transient: int, flops: int) -> None:
        """Account a replayed call: ``transient`` bytes above the current level at its peak, ``flops`` run."""
        self.peak = max(self.peak, self.current + transient)
        self.flops += flops

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the peak and the bytes left after the body, and its FLOPs, as phase ``name``."""
        self.peak = self.current
        flops, start = self.flops, time.perf_counter()
        yield
        self.phases[name] = {"peak_bytes": self.peak, "after_bytes": self.current, "flops": self.flops - flops, "trace_s": time.perf_counter() - start}

    # -- dispatch ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        fake = [is_fake(t) for t in tensors]
        if func is _aten._local_scalar_dense.default and any(fake):  # a value read from a fake tensor (metrics)
            t = tensors[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if not any(fake) and all(t.numel() <= SMALL for t in tensors):
            probe = []
            if not tensors or func.__name__.split(".")[0] in _GROWING:  # a factory: check its size on fake tensors first
                probe = _tensors(func(*args, **kwargs))
            if all(t.numel() <= SMALL for t in probe):
                with fake_tensor.unset_fake_temporarily():
                    out = func(*args, **kwargs)
                return self._account(func, args, kwargs, out)
        if any(fake) and not all(fake):  # small real tensors meet fake ones as constants (exact boolean indexing)
            convert = self.fake_mode.fake_tensor_converter.from_real_tensor
            flat = [
                convert(self.fake_mode, x, make_constant=x.numel() <= SMALL and not isinstance(x, torch.nn.Parameter))
                if isinstance(x, torch.Tensor) and not is_fake(x) else x
                for x in flat
            ]
            args, kwargs = tree_unflatten(flat, spec)
        return self._account(func, args, kwargs, func(*args, **kwargs))

    def _account(self, func, args, kwargs, out):
        for t in _tensors(out):
            self.track(t)
        packet = func._overloadpacket
        if packet is _aten._scaled_dot_product_flash_attention_for_cpu:  # the fake CPU kernel of the GPU's fused
            self.flops += sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)  # attention: not in the registry
        elif packet is _aten._scaled_dot_product_flash_attention_for_cpu_backward:
            self.flops += sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
        else:
            count = flop_registry.get(packet)
            if count is not None:
                self.flops += count(*args, **kwargs, out_val=out)
        return out


@contextlib.contextmanager
def _swap_falls_back():
    """``nn.Module.to`` swaps a fake parameter for its converted copy with ``torch.utils.swap_tensors``, which
    refuses tensors that ``FakeTensorMode`` holds weak references to; fall back to ``.data`` assignment."""
    original = torch.utils.swap_tensors

    def swap(t1, t2):
        try:
            original(t1, t2)
        except RuntimeError:
            t1.data = t2.data

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def shape_trace():
    """``with shape_trace() as trace:`` builds and runs models on fake CPU tensors, counting live bytes and
    FLOPs. Tensors made inside are fake (or small and real); use them only inside."""
    previous = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = SMALL  # constants of up to SMALL elements propagate (masks, index lists)
    mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    trace = ShapeTrace(mode)
    try:
        with _swap_falls_back(), mode, trace:
            yield trace
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = previous


def _signature(value):
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype)
    if hasattr(value, "items"):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value


@contextlib.contextmanager
def memoised_forward(adapter_cls: type, trace: ShapeTrace):
    """Replay gradient-free ``adapter_cls._forward`` calls of a traced signature (the denoiser, the input
    shapes, train/eval mode, LoRA state): the first call runs; later ones add its transient peak and FLOPs and
    return an uninitialised output of its shape. Calls with gradients always run."""
    original = adapter_cls._forward
    seen: dict = {}

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        module = self.denoiser
        lora_state = tuple(sorted({str(getattr(m, "active_adapters", "")) + str(getattr(m, "disable_adapters", "")) for m in module.modules()
                                   if hasattr(m, "active_adapters")}))
        key = (id(module), module.training, lora_state, _signature(args), _signature(kwargs))
        if key in seen:
            transient, flops, (shape, stride, dtype, device) = seen[key]
            trace.bump(transient, flops)
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
        before_peak, before, flops = trace.peak, trace.current, trace.flops
        trace.peak = trace.current
        out = original(self, *args, **kwargs)
        seen[key] = (trace.peak - before, trace.flops - flops, (out.shape, out.stride(), out.dtype, out.device))  # not the output: it must die
        trace.peak = max(trace.peak, before_peak)
        return out

    adapter_cls._forward = forward
    try:
        yield
    finally:
        adapter_cls._forward = original


__all__ = ["ALLOCATION_UNIT", "SMALL", "ShapeTrace", "is_fake", "memoised_forward", "shape_trace"]
