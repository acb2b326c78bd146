"""Run diffrl's own rollout and training code at a published shape without allocating: fake tensors, live
bytes and executed FLOPs (the engine of ``diffrl plan``).

:class:`ShapeTrace` is a ``TorchDispatchMode`` entered inside torch's ``FakeTensorMode``. Every op runs as it
would on the GPU, on fake tensors that carry shapes, dtypes and strides but no data, so a 20 B model is built
and stepped on a laptop's CPU in seconds. Two things torch's tools do not give, and why this module exists:

* **Small tensors stay real.** Sampling code reads a few values back (a mask's ``.any()``, the number of valid
  text tokens, a window's start); on fake tensors that raises ``DataDependentOutputException``. Here an op
  whose tensor inputs are all real and small (≤ :data:`SMALL` elements: seeds, schedules; integer and boolean
  tensors up to :data:`SMALL_INDEX`: masks, token ids) runs for real, and its small outputs stay real (random draws
  above :data:`SMALL_RANDOM` elements and stacks that grow past :data:`SMALL` are fake); a small real tensor meeting a fake one becomes a fake
  *constant* (torch's constant propagation then keeps e.g. a boolean index exact). Big tensors are fake.
  Values read from fake tensors (a loss's ``.item()`` for the metrics) read as 0, booleans as False, except
  those computed by ``isfinite`` (the optimizer's finiteness check), which read as True; an integer read from
  a fake tensor (a shape would depend on it) is an error.
* **Live bytes of every storage, in every grad mode.** ``torch.distributed._tools.mem_tracker.MemTracker``
  attributes memory to modules through module hooks, and fails when a module runs under ``no_grad`` inside
  the tracked region (the rollout, the reference and old-policy passes, CFG's unconditional branch); the
  caching allocator's view is what a plan needs anyway. Each new storage is counted once at its size
  rounded up to CUDA's 512-byte allocation unit, and subtracted when Python frees it (a weak reference's
  callback), so ``current`` and ``peak`` follow ``torch.cuda.memory_allocated`` / ``max_memory_allocated``.

FLOPs are counted per op with ``torch.utils.flop_counter``'s formulas (``FlopCounterMode``'s module hooks
keep activations alive, which would defeat activation checkpointing), so they are the FLOPs the code runs:
the recompute of checkpointed blocks included, frozen weights computing no weight gradients.

Repeated gradient-free denoiser calls (the rollout's steps, the reference and old-policy passes) and VAE
decodes have the same memory profile and FLOPs as the first call of the same shapes: :func:`memoised_forward`
traces the first and replays its transient peak and FLOPs for the rest, which makes a 10-step rollout of
a thousand images cost one step's and one decode chunk's trace.
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
SMALL_INDEX = 1 << 24
"""elements up to which an integer or boolean tensor whose inputs are all real stays real (a batch's token masks)"""
ALLOCATION_UNIT = 512
"""bytes: CUDA's caching allocator rounds every block up to a multiple of this"""
# ops whose output may be far larger than their inputs: their output size is checked on fake tensors first (a stack of
# a thousand per-sample noises of SMALL elements each is a big tensor: computing it for real cost most of a plan's minutes)
_GROWING = {"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "repeat", "repeat_interleave", "empty_like", "zeros_like",
            "ones_like", "full_like", "rand_like", "randn_like", "expand_copy", "tile", "stack", "cat", "concat"}
_aten = torch.ops.aten
SMALL_RANDOM = 1 << 12
"""elements above which a random tensor drawn from no tensor (``randn``, ``rand``: per-sample noise) is fake: its values
are never read back, and drawing a thousand real ones per step cost most of a plan's time"""
_RANDOM = {_aten.randn, _aten.rand, _aten.normal}
# ops through which a fake "is finite" boolean stays one (a value read from any other fake boolean reads False)
_KEEPS_TRUTH = {_aten.all, _aten.logical_and, _aten.bitwise_and, _aten._to_copy, _aten.alias, _aten.view, _aten.squeeze, _aten.clone,
                _aten.detach, _aten.lift_fresh, _aten.all}


def _op_tensors(values) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or outputs: a tensor, or a list/tuple of tensors, ``None`` and scalars
    (``Tensor[]``, ``Tensor?[]``: aten schemas nest no deeper), found without a pytree walk, which cost a tenth of a
    plan's time at one op in a few hundred microseconds."""
    if isinstance(values, torch.Tensor):
        return [values]
    out = []
    if isinstance(values, (list, tuple)):
        for v in values:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


def _small(t: torch.Tensor) -> bool:
    """Kept real: up to :data:`SMALL` elements, or :data:`SMALL_INDEX` for integers and booleans (masks, ids)."""
    return t.numel() <= (SMALL if t.is_floating_point() or t.is_complex() else SMALL_INDEX)


def is_fake(t) -> bool:
    return isinstance(t, fake_tensor.FakeTensor)


def _own_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view of another dtype (``torch.view_as_real`` of complex rotary tables: Z-Image): the
    fake converter rebuilds a view from its base and refuses a base whose dtype differs."""
    base = t._base
    return t.clone() if base is not None and base.dtype != t.dtype else t


class ShapeTrace(TorchDispatchMode):
    """Live bytes, their peak and the executed FLOPs of everything run inside it (see the module docstring).

    Use :func:`shape_trace` to enter it together with its ``FakeTensorMode``."""

    def __init__(self, fake_mode: fake_tensor.FakeTensorMode, allocation_unit: int = ALLOCATION_UNIT):
        super().__init__()
        self.fake_mode = fake_mode
        self.unit = int(allocation_unit)
        self._seen = WeakIdKeyDictionary()
        self._finite = WeakIdKeyDictionary()  # fake booleans that say "finite": they read as True (the optimizer steps)
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
        nbytes = -(-storage.nbytes() // self.unit) * self.unit
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
        tensors = _op_tensors((*args, *kwargs.values()))
        fake = [is_fake(t) for t in tensors]
        if func is _aten._local_scalar_dense.default and any(fake):  # a value read from a fake tensor
            t = tensors[0]
            if t.dtype == torch.bool:
                return t in self._finite
            if t.is_floating_point():
                return 0.0  # a metric (a loss's .item())
            raise RuntimeError(f"diffrl plan: the code read an integer from a tensor of {tuple(t.shape)} elements that is not kept real "
                               f"(more than {SMALL_INDEX} or computed from model outputs); its shapes would depend on it")
        if not tensors and func._overloadpacket in _RANDOM:
            out = func(*args, **kwargs)  # on fake tensors first (the fake mode below): real only when tiny
            if all(t.numel() <= SMALL_RANDOM for t in _op_tensors(out)):
                with fake_tensor.unset_fake_temporarily():
                    out = func(*args, **kwargs)
            return self._account(func, args, kwargs, out)
        if not any(fake) and all(_small(t) for t in tensors):
            probe = []
            if not tensors or func.__name__.split(".")[0] in _GROWING:  # a factory: check its size on fake tensors first
                probe = _op_tensors(func(*args, **kwargs))
            if all(_small(t) for t in probe):
                with fake_tensor.unset_fake_temporarily():
                    out = func(*args, **kwargs)
                return self._account(func, args, kwargs, out)
        if any(fake) and not all(fake):  # small real tensors meet fake ones as constants (exact boolean indexing)
            convert = self.fake_mode.fake_tensor_converter.from_real_tensor
            flat, spec = tree_flatten((args, kwargs))
            flat = [
                convert(self.fake_mode, _own_dtype(x), make_constant=x.numel() <= SMALL and not isinstance(x, torch.nn.Parameter))
                if isinstance(x, torch.Tensor) and not is_fake(x) else x
                for x in flat
            ]
            args, kwargs = tree_unflatten(flat, spec)
        return self._account(func, args, kwargs, func(*args, **kwargs))

    def _account(self, func, args, kwargs, out):
        outputs = _op_tensors(out)
        for t in outputs:
            self.track(t)
        packet = func._overloadpacket
        if packet in _KEEPS_TRUTH and any(t in self._finite for t in _op_tensors((*args, *kwargs.values())) if is_fake(t)):
            for t in outputs:
                self._finite[t] = True
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
def _finite_checks(trace: ShapeTrace):
    """Marks the result of ``torch.isfinite`` / ``Tensor.isfinite`` on a fake tensor (it decomposes into several ops
    below the dispatcher, so the mark is set at the function level) so that reading it gives True. The two are wrapped
    for the trace's duration rather than watched by a ``TorchFunctionMode``, which sat in front of every other torch call
    too (a plan's every op paid for it)."""
    function, method = torch.isfinite, torch.Tensor.isfinite
    own_method = "isfinite" in vars(torch.Tensor)  # else inherited from torch._C.TensorBase: restored by deleting ours

    def mark(out):
        if isinstance(out, torch.Tensor) and is_fake(out):
            trace._finite[out] = True
        return out

    torch.isfinite = functools.wraps(function)(lambda *args, **kwargs: mark(function(*args, **kwargs)))
    torch.Tensor.isfinite = functools.wraps(method)(lambda self, *args, **kwargs: mark(method(self, *args, **kwargs)))
    try:
        yield
    finally:
        torch.isfinite = function
        if own_method:
            torch.Tensor.isfinite = method
        else:
            del torch.Tensor.isfinite


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
def shape_trace(allocation_unit: int = ALLOCATION_UNIT):
    """``with shape_trace() as trace:`` builds and runs models on fake CPU tensors, counting live bytes (each
    storage rounded up to ``allocation_unit``: CUDA's 512 by default, 1 to compare with a CPU run) and FLOPs.
    Tensors made inside are fake (or small and real); use them only inside."""
    previous = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = SMALL  # constants of up to SMALL elements propagate (masks, index lists)
    mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
    trace = ShapeTrace(mode, allocation_unit)
    try:
        with _swap_falls_back(), mode, trace, _finite_checks(trace):
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


def _like(value):
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return type(value)(_like(v) for v in value)
    return value


def _make(spec):
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device=spec[4])
    if isinstance(spec, (tuple, list)):
        return type(spec)(_make(v) for v in spec)
    return spec


@contextlib.contextmanager
def memoised(cls: type, name: str, trace: ShapeTrace, module_attr: str | None = None):
    """Replay gradient-free calls of ``cls.<name>`` with a traced signature (the object, its train/eval mode,
    the LoRA state of ``getattr(self, module_attr)``, the input shapes): the first call runs; later ones add
    its transient peak and FLOPs to the trace and return uninitialised tensors of its outputs' shapes (a
    tensor or a tuple of them). Calls with gradients always run."""
    original = getattr(cls, name)
    seen: dict = {}

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        module = getattr(self, module_attr) if module_attr else self
        lora_state = tuple(sorted({str(getattr(m, "active_adapters", "")) + str(getattr(m, "disable_adapters", "")) for m in module.modules()
                                   if hasattr(m, "active_adapters")})) if module_attr else ()
        key = (id(module), getattr(module, "training", None), lora_state, _signature(args), _signature(kwargs))
        if key in seen:
            transient, flops, spec = seen[key]
            trace.bump(transient, flops)
            return _make(spec)
        before_peak, before, flops = trace.peak, trace.current, trace.flops
        trace.peak = trace.current
        out = original(self, *args, **kwargs)
        seen[key] = (trace.peak - before, trace.flops - flops, _like(out))  # not the output itself: it must die
        trace.peak = max(trace.peak, before_peak)
        return out

    setattr(cls, name, call)
    try:
        yield
    finally:
        setattr(cls, name, original)


@contextlib.contextmanager
def memoised_forward(adapter, trace: ShapeTrace):
    """:func:`memoised` on the adapter's denoiser forward (``_forward``: the rollout's steps, the reference and
    old-policy passes) and on its VAE's ``decode`` (the rollout's decode chunks)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(memoised(type(adapter), "_forward", trace, module_attr="denoiser"))
        vae = getattr(adapter, "vae", None)
        if vae is not None and hasattr(type(vae), "decode"):
            stack.enter_context(memoised(type(vae), "decode", trace))
        yield


__all__ = ["ALLOCATION_UNIT", "SMALL", "SMALL_RANDOM", "ShapeTrace", "is_fake", "memoised", "memoised_forward", "shape_trace"]
