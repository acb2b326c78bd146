"""The Wan2.2 text-to-video family (A14B): Wan2.1's pipeline with two experts switched at a timestep boundary.

Everything but the denoiser is Wan2.1's (:class:`~pipelines.wan.adapter.WanAdapter`: UMT5 prompts, the causal 3-D VAE,
the flow-matching sigmas with the scheduler's ``flow_shift``, decode). The denoiser is
:class:`~pipelines.wan22.experts.TwoExperts`: ``transformer`` (high noise) and ``transformer_2`` (low noise), one
``WanTransformer3DModel`` each, as ``diffusers.WanPipeline`` runs them with ``boundary_ratio``:

* Expert per step: ``transformer`` where the diffusers timestep ``t = 1000·σ ≥ boundary_ratio · num_train_timesteps``,
  else ``transformer_2`` (WanPipeline's test). diffrl picks the expert **per sample**, so training batches that mix
  noise levels (DPO, NFT, AWM) run each sample through the expert that would have produced it; rollout and training
  therefore compute each step's log-prob with the same expert.
* Guidance per expert: the high-noise steps use the sampler's ``guidance_scale``, the low-noise steps
  ``guidance_scale_2`` (``model.options.guidance_scale_2``; null: the same scale, as WanPipeline when
  ``guidance_scale_2`` is None). ``guidance_scale == 1`` runs no unconditional branch on either expert (WanPipeline's
  ``do_classifier_free_guidance`` reads the first scale only).
* LoRA: on the attention projections of both experts, or of the ones ``model.lora.experts`` names (``[high]``,
  ``[low]``; :meth:`Wan22Adapter.expert_lora_targets`).

``model.path`` is a local diffusers Wan2.2 folder (``transformer/``, ``transformer_2/``, ``vae/``, ``text_encoder/``,
``tokenizer/``, ``scheduler/`` and ``model_index.json`` with ``boundary_ratio``); with no path the family builds a tiny
random configuration (two tiny experts of different seeds).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import register_family
from pipelines.flops import wan_forward_flops
from pipelines.latent import check_folder, own_memory
from pipelines.shapes import SHAPES, Shape, building, family_components, register_shape
from pipelines.wan.adapter import TINY_WAN_TRANSFORMER, WAN21_VAE, WanAdapter, build_tiny_wan_components, build_wan_components, load_wan_components
from pipelines.wan22.experts import EXPERTS, TwoExperts

# Wan2.2-T2V-A14B (Hub: Wan-AI/Wan2.2-T2V-A14B-Diffusers). transformer/config.json and transformer_2/config.json are one
# config, the same as Wan2.1-T2V-14B's (patch (1, 2, 2), 40 heads × 128, ffn 13824, 40 layers, text_dim 4096, freq_dim 256,
# rms_norm_across_heads, eps 1e-6, rope_max_seq_len 1024, in/out channels 16); the VAE is Wan2.1's. model_index.json:
# boundary_ratio 0.875 (Wan2.2's wan/configs/wan_t2v_A14B.py: boundary 0.875, sample_guide_scale (3.0 low, 4.0 high),
# sample_shift 12.0, 40 steps). 28.58 B parameters: two experts of 14.29 B; one runs per step.
WAN22_A14B = register_shape(Shape(
    "wan22_a14b", "wan22", dict(SHAPES["wan21_14b"].transformer), WAN21_VAE, {"umt5": 4096}, 512, 28.58,
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json, transformer_2/config.json, vae/config.json, model_index.json",
), full=True)
A14B_BOUNDARY_RATIO = 0.875
WAN22_COMPONENTS = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler")


def build_tiny_wan22_components(seed: int = 0) -> dict:
    """Wan's tiny random components (:func:`build_tiny_wan_components`) plus a second tiny expert of another seed
    (``seed + 3``) and A14B's boundary ratio."""
    from diffusers import WanTransformer3DModel

    parts = build_tiny_wan_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 3)
        parts["transformer_2"] = WanTransformer3DModel(**TINY_WAN_TRANSFORMER)
    parts["boundary_ratio"] = A14B_BOUNDARY_RATIO
    return parts


def build_wan22_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """Wan's components at a published shape (:func:`build_wan_components`) plus the low-noise expert at the same
    config (seed ``seed + 3``), random, on ``device`` in ``dtype``."""
    from diffusers import WanTransformer3DModel

    parts = build_wan_components(seed, shape, device, dtype)
    with building(device, dtype, seed + 3):
        parts["transformer_2"] = WanTransformer3DModel(**shape.transformer)
    parts["boundary_ratio"] = A14B_BOUNDARY_RATIO
    return parts


def load_wan22_components(path: str | Path) -> dict:
    """Components of a local Wan2.2 diffusers folder (``local_files_only``): Wan's, ``transformer_2`` and the
    ``boundary_ratio`` of ``model_index.json`` (``None`` when it has none)."""
    from diffusers import WanTransformer3DModel

    folder = Path(path)
    check_folder(folder, "Wan2.2", WAN22_COMPONENTS)
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"Wan2.2 model folder {folder} lacks model_index.json (its boundary_ratio picks the expert per step)")
    ratio = json.loads(index_path.read_text()).get("boundary_ratio")
    parts = load_wan_components(folder)
    parts["transformer_2"] = own_memory(WanTransformer3DModel.from_pretrained(str(folder / "transformer_2"), local_files_only=True))
    parts["boundary_ratio"] = None if ratio is None else float(ratio)
    parts["folder"] = str(folder)
    return parts


@register_family("wan22")
class Wan22Adapter(WanAdapter):
    """Wan2.2 text-to-video with two experts (A14B): :class:`~pipelines.wan.adapter.WanAdapter` whose denoiser is
    :class:`~pipelines.wan22.experts.TwoExperts`.

    Args:
        path, dtype, device, seed, num_frames, decode_chunk, drop_text_encoders, max_sequence_length, negative_prompt,
            flow_shift, cfg_mode: as :class:`~pipelines.wan.adapter.WanAdapter` (Wan2.2's own T2V-A14B config samples
            with shift 12.0: ``flow_shift=12.0`` follows it).
        shape: with no ``path``, ``tiny`` (the test configuration) or ``wan22_a14b`` / ``full`` (A14B's two experts at
            their published config, random weights; :mod:`pipelines.shapes`).
        boundary_ratio: the expert switch, ``transformer`` where ``t ≥ boundary_ratio · num_train_timesteps``; ``None``:
            the folder's ``model_index.json`` (0.875 for the tiny and published configurations).
        guidance_scale_2: the CFG scale of the low-noise expert's steps (WanPipeline's ``guidance_scale_2``; A14B's
            recommended pair is 4.0 high / 3.0 low); ``None``: the sampler's ``guidance_scale`` on both.
    """

    hub_components = WAN22_COMPONENTS
    family = "Wan2.2"
    shape_family = "wan22"
    # two experts: no one-transformer diffusers LoRA file holds them (diffrl export-lora refuses the family)
    lora_pipeline = None
    experts = EXPERTS

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, num_frames: int = 5,
        decode_chunk: int = 4, drop_text_encoders: bool = False, max_sequence_length: int = 512, negative_prompt: str = "",
        flow_shift: float | None = None, cfg_mode: str = "split", shape: str = "tiny", boundary_ratio: float | None = None,
        guidance_scale_2: float | None = None,
    ):
        if boundary_ratio is not None and not 0.0 < float(boundary_ratio) < 1.0:
            raise ValueError(f"Wan2.2: boundary_ratio={boundary_ratio} must lie in (0, 1) (A14B: 0.875); set model.options.boundary_ratio accordingly")
        if guidance_scale_2 is not None and not float(guidance_scale_2) > 0:
            raise ValueError(f"Wan2.2: guidance_scale_2={guidance_scale_2} must be positive (or null: the sampler's guidance_scale); "
                             "set model.options.guidance_scale_2")
        self._boundary_option = None if boundary_ratio is None else float(boundary_ratio)
        super().__init__(
            path=path, dtype=dtype, device=device, seed=seed, num_frames=num_frames, decode_chunk=decode_chunk,
            drop_text_encoders=drop_text_encoders, max_sequence_length=max_sequence_length, negative_prompt=negative_prompt,
            flow_shift=flow_shift, cfg_mode=cfg_mode, shape=shape,
        )
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(guidance_scale_2)

    def _components(self, *, path, shape: str, seed: int, device: str, dtype: str) -> dict:
        """Wan2.2's components with the two experts joined into one :class:`TwoExperts` under ``transformer``."""
        parts = family_components("wan22", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                  load=load_wan22_components, tiny=build_tiny_wan22_components, build=build_wan22_components)
        ratio = parts.pop("boundary_ratio")
        folder = parts.pop("folder", None)
        if self._boundary_option is None and ratio is None:
            raise ValueError(f"Wan2.2 model folder {folder}: model_index.json has no boundary_ratio, so it is a one-transformer Wan model; "
                             "load it with model.family=wan, or give +model.options.boundary_ratio=<ratio>")
        self.boundary_ratio = ratio if self._boundary_option is None else self._boundary_option
        T = int(parts["scheduler"].get("num_train_timesteps", 1000))
        parts["transformer"] = TwoExperts(parts["transformer"], parts.pop("transformer_2"), self.boundary_ratio * T)
        return parts

    # -- the experts ----------------------------------------------------------------------------
    def expert_of(self, sigma: torch.Tensor) -> list[str]:
        """The expert that runs at each noise level of ``sigma [B]`` (``"high"`` | ``"low"``)."""
        high = self.denoiser.is_high(1000.0 * torch.as_tensor(sigma, dtype=torch.float32).reshape(-1))
        return [EXPERTS[0] if h else EXPERTS[1] for h in high.tolist()]

    def expert_lora_targets(self, targets: list[str], experts: list[str]) -> list[str]:
        """Full module names of the ``experts``' modules that ``targets`` (suffixes, peft's matching) name, for a LoRA on
        those experts only (``model.lora.experts``); an unknown expert is a one-line error naming the valid ones."""
        unknown = [e for e in experts if e not in EXPERTS]
        if unknown or not experts:
            raise ValueError(f"model.lora.experts={list(experts)} is invalid: Wan2.2's experts are {list(EXPERTS)} (high noise, low noise); "
                             "give [high], [low] or [high, low], or null for both")
        prefixes = tuple(f"{e}." for e in experts)
        return [name for name, _ in self.denoiser.named_modules()
                if name.startswith(prefixes) and any(name.endswith(f".{t}") for t in targets)]

    def fsdp_blocks(self) -> list[torch.nn.Module]:
        """The blocks of both experts (each its own FSDP2 unit: only the running expert's blocks are gathered)."""
        return [*self.denoiser.high.blocks, *self.denoiser.low.blocks]

    def sequence_parallel_transformers(self) -> list[torch.nn.Module]:
        """Both experts: each splits its video tokens over the sequence-parallel group (``model.sequence_parallel``)."""
        return [self.denoiser.high, self.denoiser.low]

    # -- guidance per expert --------------------------------------------------------------------
    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """:meth:`ModelAdapter.predict` with WanPipeline's guidance per expert: samples on the high-noise expert take
        ``guidance_scale``, those on the low-noise expert ``guidance_scale_2``. With one scale for both (or guidance 1),
        the denoiser's own per-sample dispatch suffices; otherwise a batch whose samples fall on both sides runs each
        side as its own prediction and the rows go back in order."""
        g2 = self.guidance_scale_2
        if guidance_scale == 1.0 or g2 is None or g2 == guidance_scale:
            return super().predict(latents, sigma, cond, guidance_scale)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        high = self.denoiser.is_high(1000.0 * sigma)
        if bool(high.all()) or not bool(high.any()):
            return super().predict(latents, sigma, cond, guidance_scale if bool(high.all()) else g2)
        rows = [high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)]
        # each part is its own prediction (under CUDA graphs its own graph-tree step): keep the first part's rows in
        # memory of their own before the second part runs
        predict = super().predict
        parts = [predict(latents[r], sigma[r], cond[r], g).clone() for r, g in zip(rows, (guidance_scale, g2))]
        return torch.cat(parts)[torch.argsort(torch.cat(rows))]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """FLOPs of one forward of the expert that runs: :func:`pipelines.flops.wan_forward_flops` over the video tokens
        and every (padded) UMT5 token, as Wan2.1's. A14B's two experts share one config, so every step costs the same;
        experts of different configs give the larger count (an upper bound). LoRA is counted on the running expert (an
        upper bound when ``model.lora.experts`` names one)."""
        _, f, h, w = self.latent_shape(height, width)
        p_t, p_h, p_w = self.patch_size
        tokens, text = (f // p_t) * (h // p_h) * (w // p_w), self.prompt_tokens()
        return max(wan_forward_flops(dict(e.config), tokens, text, lora_rank) for e in (self.denoiser.high, self.denoiser.low))

    # -- saving ---------------------------------------------------------------------------------
    def components(self) -> dict:
        parts = super().components()
        parts["transformer"], parts["transformer_2"] = self.denoiser.high, self.denoiser.low
        return parts

    def save_pretrained(self, folder: str | Path) -> Path:
        """A diffusers Wan2.2 folder (``transformer/``, ``transformer_2/``, …; ``model_index.json`` with
        ``boundary_ratio``) that ``model.path`` and ``WanPipeline.from_pretrained`` load."""
        folder = super().save_pretrained(folder)
        index_path = folder / "model_index.json"
        index = json.loads(index_path.read_text())
        index["transformer_2"] = ["diffusers", type(self.denoiser.low).__name__]
        index["boundary_ratio"] = self.boundary_ratio
        index_path.write_text(json.dumps(index, indent=2))
        return folder


__all__ = ["Wan22Adapter", "build_tiny_wan22_components", "load_wan22_components"]
