"""fp32 master weights for low-precision trainable parameters: mixed-precision full fine-tuning.

With ``model.dtype=bfloat16`` and full fine-tuning (``model.lora.rank=0``) the denoiser's parameters are bf16, and
AdamW stepping them directly rounds each update to bf16: an update smaller than half a unit in the last place of a
weight (``|Δw| < 2⁻⁹·|w|``, e.g. lr 1e-5 against weights of size ~0.01–1) is lost. :class:`MasterWeights` keeps a
bf16 *working copy* (the module's own parameters, which every forward and backward uses, so rollout and training
numerics are those of the bf16 model, bit for bit) and an fp32 *master* of each low-precision trainable parameter,
which is what the optimizer holds and steps. For every such parameter ``p`` (bf16) and its master ``m`` (fp32):

    g_m = Σ_backwards fp32(∂L/∂p)      each backward's bf16 gradient, upcast and summed in fp32 (a post-accumulate-
                                       grad hook moves it into ``m.grad`` and frees ``p.grad``)
    m   ← AdamW(m, g_m)                the optimizer's moments are fp32 too
    p   ← round_bf16(m)                round to nearest even (:meth:`MasterWeights.write_back`)

so an update below half a bf16 ulp accumulates in ``m`` until it moves ``p``. Gradient clipping and the non-finite
check run on the masters' fp32 gradients. fp32 parameters (a LoRA's adapters: peft keeps them fp32 on a bf16 base)
need no master and are stepped as they are. Memory: 4 bytes per low-precision trainable parameter for the master and
4 for its gradient (the bf16 gradient lives only until its hook runs).

Under FSDP2 ``p`` is the rank's DTensor shard (bf16, so the gathered compute weights are unchanged) and ``m`` an fp32
DTensor of the same placement: each rank keeps and steps its shard's master; FSDP2 reduce-scatters the gradients in
fp32 (``MixedPrecisionPolicy(reduce_dtype=float32)``, :func:`diffrl.engine.parallel.apply_fsdp`).

float16 is refused (:func:`check_supported`): its gradients underflow without a loss scaler, which diffrl does not have.
"""

from __future__ import annotations

import torch
from torch import nn

from diffrl.engine import parallel

MASTER_DTYPE = torch.float32


def check_supported(named_trainable: list[tuple[str, nn.Parameter]], *, lora: bool) -> None:
    """Raise a one-line ``ValueError`` when a trainable parameter is float16: fp32 masters of fp16 weights would still
    take fp16 gradients, which underflow unless the loss is scaled, and diffrl has no loss scaler."""
    fp16 = [name for name, p in named_trainable if p.dtype == torch.float16]
    if fp16:
        what = "its LoRA adapters are" if lora else "full fine-tuning (model.lora.rank=0) trains"
        raise ValueError(f"model.dtype=float16: {what} float16 parameters ({fp16[0]} …), whose gradients underflow without a loss scaler, "
                         "which diffrl does not have; use model.dtype=bfloat16 (fp32 master weights, bf16 compute) or float32")


class MasterWeights:
    """fp32 masters of the low-precision parameters among ``named_params`` (see the module docstring).

    Args:
        named_params: ``(name, parameter)`` of every trainable parameter, in the optimizer's order.

    :attr:`stepped` lists what the optimizer holds, in that order: each parameter's master, or the parameter itself
    when it is already fp32."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]]):
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.masters: dict[str, nn.Parameter] = {}
        self._hooks = []
        for name, p in named_params:
            if p.dtype == MASTER_DTYPE:
                continue
            master = nn.Parameter(p.detach().to(MASTER_DTYPE), requires_grad=True)
            self.masters[name] = master
            self._hooks.append(p.register_post_accumulate_grad_hook(self._move_grad_hook(master)))

    @staticmethod
    def needed(named_params: list[tuple[str, nn.Parameter]]) -> bool:
        """Whether any trainable parameter is below fp32 (bf16), so that masters are kept."""
        return any(p.dtype != MASTER_DTYPE for _, p in named_params)

    @property
    def stepped(self) -> list[nn.Parameter]:
        return [self.masters.get(name, p) for name, p in zip(self.names, self.params)]

    @staticmethod
    def _move_grad_hook(master: nn.Parameter):
        def move(p: torch.Tensor) -> None:  # m.grad += fp32(p.grad); p.grad freed
            grad = p.grad
            if grad is None:
                return
            if master.grad is None:
                master.grad = grad.detach().to(MASTER_DTYPE)
            else:
                master.grad.add_(grad.detach())
            p.grad = None

        return move

    def collect_grads(self) -> None:
        """Move any bf16 gradient the hooks did not (an FSDP2 without post-accumulate hooks on sharded parameters, or a
        gradient set by hand) into its master's; idempotent."""
        for name, p in zip(self.names, self.params):
            master = self.masters.get(name)
            if master is not None and p.grad is not None:
                self._move_grad_hook(master)(p)

    def drop_grads(self) -> None:
        """Forget the working copy's gradients (the masters' are the optimizer's to clear)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """``p ← round(m)`` for every master (round to nearest even)."""
        for name, p in zip(self.names, self.params):
            master = self.masters.get(name)
            if master is not None:
                p.copy_(master)

    def state(self) -> dict[str, torch.Tensor]:
        """Name → fp32 master (DTensor shards under FSDP2), of the low-precision parameters only."""
        return {name: m.detach() for name, m in self.masters.items()}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the masters named in ``state`` from whole tensors (a checkpoint's; bf16 values of an older checkpoint are
        upcast exactly), then round them into the working copy."""
        for name, value in state.items():
            master = self.masters.get(name)
            if master is not None:
                parallel.load_full(master, value.to(MASTER_DTYPE))
        self.write_back()

    @torch.no_grad()
    def to(self, device, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Move the masters, their gradients and their optimizer states (tensors with a shape) to ``device``."""
        for master in self.masters.values():
            master.data = master.data.to(device)
            if master.grad is not None:
                master.grad = master.grad.to(device)
            state = optimizer.state.get(master, {}) if optimizer is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    state[key] = value.to(device)

    def nbytes(self) -> int:
        """Bytes of the masters (on this rank: shards under FSDP2)."""
        return sum(_local(m).numel() * m.element_size() for m in self.masters.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


__all__ = ["MASTER_DTYPE", "MasterWeights", "check_supported"]
