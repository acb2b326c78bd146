"""DiffusionFlopsCounter: analytic FLOPs of rollouts and training passes, and MFU.

The FLOPs of one denoiser forward come from the model family (``ModelAdapter.forward_flops``: matrix
products, convolutions and attention at 2 FLOPs per multiply-add, from the model config; the per-architecture
formulas live in ``pipelines/flops.py``). From them: a training pass counts 3 forwards (forward + backward);
a forward-only pass (rollout, reference, old policy) counts 1, i.e. 1/3 of a training pass; CFG adds the
unconditional forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.base import ModelAdapter

# dense bf16 peak FLOP/s by device name (vendor datasheets); override with peak_flops for measured values
DEVICE_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
}


@dataclass
class DiffusionFlopsCounter:
    """Analytic FLOPs of rollouts and training passes of one denoiser, and the MFU they reach.

    Args:
        sample_flops: FLOPs of one conditional denoiser forward of one sample (the model family's
            ``ModelAdapter.forward_flops`` at the image size, LoRA included).
        device_name: looked up in ``DEVICE_PEAK_FLOPS`` (substring match) unless ``peak_flops`` is given.
        peak_flops: FLOP/s per device to divide by (e.g. a measured matmul peak).
        rollout_sample_flops: FLOPs of one rollout forward of one sample when they differ from ``sample_flops``:
            with ``model.fuse_lora_rollout`` the rollout runs the LoRA folded into the weights, so its LoRA
            matmuls are not executed (None: ``sample_flops``).
    """

    sample_flops: float
    device_name: str | None = None
    peak_flops: float | None = None
    rollout_sample_flops: float | None = None

    def __post_init__(self):
        if not self.sample_flops > 0:
            raise ValueError(f"sample_flops must be > 0 (FLOPs of one forward of one sample), got {self.sample_flops}")
        if self.peak_flops is None and self.device_name is not None:
            match = [v for k, v in DEVICE_PEAK_FLOPS.items() if k.lower() in self.device_name.lower()]
            self.peak_flops = match[0] if match else None

    def forward_flops(self, batch: int = 1) -> float:
        """FLOPs of one denoiser forward over ``batch`` samples (no CFG)."""
        return batch * self.sample_flops

    def rollout_flops(self, num_images: int, num_steps: int, guidance_scale: float = 1.0) -> float:
        """Sampling ``num_images`` with ``num_steps`` forwards each (×2 with CFG)."""
        per = self.sample_flops if self.rollout_sample_flops is None else self.rollout_sample_flops
        return num_images * per * num_steps * (2 if guidance_scale != 1.0 else 1)

    def train_flops(self, num_samples: int, trained_steps: int, guidance_scale: float = 1.0, extra_forwards: int = 0) -> float:
        """A training pass over ``num_samples × trained_steps`` forwards: forward + backward = 3 forwards
        (the detached unconditional CFG branch is forward-only), plus ``extra_forwards`` forward-only
        passes per sample-step (reference for the KL, old policy for NFT)."""
        units = num_samples * trained_steps
        per = self.forward_flops(1)
        cond = 3 * per * units
        uncond = per * units if guidance_scale != 1.0 else 0.0
        return cond + uncond + extra_forwards * per * units

    def mfu(self, flops: float, seconds: float, num_devices: int = 1) -> float | None:
        """Model FLOPs utilisation: ``flops / (seconds · peak · devices)`` (None without a known peak)."""
        if not self.peak_flops or seconds <= 0:
            return None
        return flops / (seconds * self.peak_flops * num_devices)


def counter_for_adapter(
    adapter: ModelAdapter, height: int, width: int, *, lora_rank: int = 0, device_name: str | None = None, peak_flops: float | None = None,
    fused_rollout: bool = False,
) -> DiffusionFlopsCounter:
    """A counter for a model adapter's denoiser at image size ``height × width``: the family declares the FLOPs
    of one forward (``adapter.forward_flops``; a family without a formula raises ``ValueError``). With
    ``fused_rollout`` (``model.fuse_lora_rollout``) rollout forwards are counted without their LoRA matmuls."""
    rollout = adapter.forward_flops(height, width, lora_rank=0) if fused_rollout else None
    return DiffusionFlopsCounter(adapter.forward_flops(height, width, lora_rank=lora_rank), device_name, peak_flops, rollout)
