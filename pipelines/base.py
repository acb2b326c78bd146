"""The model-adapter protocol: everything diffrl's samplers, losses and workers need from a family.

A family is plugged in once by subclassing :class:`ModelAdapter` and registering it with
:func:`register_family`. Rollout and training both call the same :meth:`ModelAdapter.predict` on the
same ``denoiser`` module, so log-probs recorded during sampling and recomputed in training agree.

``predict`` is a template: classifier-free guidance is written once here, around the family's
``_forward`` (one conditional forward) and its ``combine_guidance`` rule.

Conventions (docs/architecture.md): ``sigma ∈ [0, 1]`` with 1 = pure noise, ``x_σ = (1 − σ)·x0 + σ·ε``, velocity
``v = ε − x0``; diffusers' "timestep" is ``1000·σ`` and appears only inside ``_forward``.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Callable

import torch
from tensordict import TensorDict
from torch import nn

from diffrl.hub import component_patterns, resolve_model_folder
from pipelines.schedules import shifted_sigmas
from pipelines.shapes import PARENT_SHAPES, SHAPES, check_shape_path, resolve_shape

_FAMILIES: dict[str, Callable[..., "ModelAdapter"]] = {}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CFG_MODES = ("split", "batched")


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` | ``"bfloat16"`` | ``"float16"`` → the torch dtype (``model.dtype``)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)} (model.dtype)")
    return DTYPES[name]


def check_cfg_mode(cfg_mode: str) -> str:
    """``cfg_mode`` when it is one of :data:`CFG_MODES`, else a ``ValueError`` naming the option."""
    if cfg_mode not in CFG_MODES:
        raise ValueError(f"model.options.cfg_mode must be one of {CFG_MODES}, got {cfg_mode!r}")
    return cfg_mode


def guidance_branches(cond: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The conditional and unconditional conditionings of CFG: every entry ``k`` of ``cond`` (not itself a
    ``negative_*`` entry), and ``negative_k`` under the name ``k``."""
    keys = [k for k in cond.keys() if not k.startswith("negative_")]
    missing = [f"negative_{k}" for k in keys if f"negative_{k}" not in cond.keys()]
    if missing:
        raise ValueError(f"classifier-free guidance (guidance_scale ≠ 1) needs the unconditional embeddings {missing} in cond; encode_prompts did not return them")
    return {k: cond[k] for k in keys}, {k: cond[f"negative_{k}"] for k in keys}


@dataclasses.dataclass(frozen=True, eq=False)
class EditPrompt:
    """An editing prompt: the instruction and the source image it applies to.

    Editing families (``ModelAdapter.editing``) take lists of these wherever a text-to-image family takes
    prompt strings; ``str(record)`` is the instruction (what rewards, logs and tables show).

    Attributes:
        instruction: the edit instruction (``"make it blue"``).
        source: the source image, uint8 ``[3, H, W]``.
        name: where the record came from (a file name or an id), for logs; ``""`` when none.
    """

    instruction: str
    source: torch.Tensor
    name: str = ""

    def __post_init__(self):
        src = self.source
        if not (isinstance(src, torch.Tensor) and src.dtype == torch.uint8 and src.ndim == 3 and src.shape[0] == 3):
            got = f"{src.dtype} {tuple(src.shape)}" if isinstance(src, torch.Tensor) else type(src).__name__
            raise ValueError(f"EditPrompt {self.name or self.instruction!r}: source must be a uint8 RGB image [3, H, W], got {got}")

    def __str__(self) -> str:
        return self.instruction


def split_prompts(prompts: Sequence) -> tuple[list[str], torch.Tensor | None]:
    """Prompt strings, or :class:`EditPrompt` records → ``(texts, sources)``: the instructions and the stacked
    uint8 sources ``[B, 3, H, W]`` (``None`` for plain strings). Records of different source sizes must be
    resized first (:func:`resize_sources`); a mix of strings and records is an error."""
    records = [isinstance(p, EditPrompt) for p in prompts]
    if not any(records):
        return [str(p) for p in prompts], None
    if not all(records):
        raise ValueError("a prompt list mixes text prompts and EditPrompt records; an editing run needs a source image for every prompt")
    sizes = sorted({tuple(p.source.shape) for p in prompts})
    if len(sizes) > 1:
        raise ValueError(f"editing prompts have sources of different sizes {sizes}; resize them to the sampler's height × width first")
    return [p.instruction for p in prompts], torch.stack([p.source for p in prompts])


def resize_sources(prompts: Sequence, height: int, width: int) -> list:
    """Every :class:`EditPrompt` with its source resized to ``height × width`` (bicubic on the uint8 image,
    rounded back to uint8; sources already of that size are kept bit for bit); strings unchanged."""
    out = []
    for p in prompts:
        if isinstance(p, EditPrompt) and tuple(p.source.shape[1:]) != (height, width):
            x = torch.nn.functional.interpolate(p.source[None].float(), size=(height, width), mode="bicubic", align_corners=False, antialias=True)
            p = EditPrompt(p.instruction, x[0].round().clamp(0, 255).to(torch.uint8), p.name)
        out.append(p)
    return out


def check_source_images(adapter, prompts: list[str], images: torch.Tensor | None) -> None:
    """One-line ``ValueError`` unless ``images`` are an editing ``adapter``'s float sources ``[len(prompts), 3, H, W]``
    with ``H, W`` multiples of its VAE factor × 2 (the packing)."""
    if images is None or not images.is_floating_point() or images.ndim != 4 or tuple(images.shape[:2]) != (len(prompts), 3):
        got = "None" if images is None else f"{images.dtype} {tuple(images.shape)}"
        raise ValueError(f"{adapter.family} edits images: encode_prompts needs float source images [{len(prompts)}, 3, H, W] in [0, 1], one per prompt; got {got}")
    adapter._check_size(images.shape[-2], images.shape[-1], adapter.vae_factor * 2)


class ModelAdapter(abc.ABC):
    """One model family over diffusers components.

    Attributes:
        prediction_type: ``"flow"`` (velocity) or ``"epsilon"``.
        denoiser: the ``nn.Module`` that LoRA wraps and the optimizer trains.
        lora_target_modules: module-name suffixes that LoRA attaches to.
        shift: the family's default sigma-schedule shift.
        cfg_mode: how a guided :meth:`predict` runs its two branches (``model.options.cfg_mode``, see there).
        editing: ``True`` for an editing family: :meth:`encode_prompts` takes the source images, and prompts
            are :class:`EditPrompt` records.
        hub_components: the sub-folders of a diffusers repository the family loads; a ``model.path`` given as a
            Hub id (``org/name``) downloads only these (and ``model_index.json``), see :func:`resolve_model_path`.
        lora_pipeline, lora_component: the diffusers pipeline whose ``load_lora_weights`` reads the family's exported
            LoRA (``diffrl export-lora``) and the component its keys are prefixed with; ``None``: no diffusers format.
        guidance_distilled: the guidance scale enters a guidance embedding and no unconditional branch runs (FLUX.1-dev,
            Kontext); otherwise CFG with the negative embeddings.
        tiny_size: the image side (pixels) the family's ``shape=tiny`` configuration samples at in tests and smoke runs.
    """

    prediction_type: str = "flow"
    editing: bool = False
    cudagraph_steps: bool = False  # set by the engine under compile mode reduce-overhead (see predict)
    lora_target_modules: list[str] = []
    shift: float = 1.0
    cfg_mode: str = "split"
    hub_components: tuple[str, ...] = ()
    lora_pipeline: str | None = None
    lora_component: str = "transformer"
    guidance_distilled: bool = False
    tiny_size: int = 32
    denoiser: nn.Module

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """Text conditioning for ``prompts`` as a TensorDict with batch size ``[len(prompts)]``.

        It holds the positive embeddings ``k`` and, for CFG, the negative (unconditional) ones ``negative_k``.

        An editing family (``editing = True``) takes ``encode_prompts(prompts, images)``: ``images`` float
        ``[B, 3, H, W]`` in [0, 1], the source image of each instruction; the returned conditioning then holds
        everything the denoiser reads, the source's latents included (with their ``negative_*`` twins), so a
        trajectory's ``cond`` alone reproduces its log-probs in training.
        """

    def encode(self, prompts: list[str], images: torch.Tensor | None = None) -> TensorDict:
        """:meth:`encode_prompts` with the editing contract checked: an editing family needs one source
        image per prompt, any other family none (a one-line ``ValueError`` naming the fix otherwise)."""
        if self.editing:
            if images is None:
                raise ValueError(
                    f"model family {type(self).__name__} is an editing model: every prompt needs a source image "
                    "(set trainer.prompts to a JSONL file or folder of {source, instruction} records)"
                )
            if images.ndim != 4 or images.shape[0] != len(prompts) or images.shape[1] != 3:
                raise ValueError(f"{type(self).__name__}: expected source images [{len(prompts)}, 3, H, W] for {len(prompts)} prompts, got {tuple(images.shape)}")
            return self.encode_prompts(prompts, images)
        if images is not None:
            raise ValueError(f"model family {type(self).__name__} is a text-to-image model and takes no source images; use an editing family (e.g. model.family=flux_kontext)")
        return self.encode_prompts(prompts)

    @abc.abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one latent (no batch dim) for an image of ``height × width`` pixels."""

    @abc.abstractmethod
    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One conditional denoiser forward.

        Args:
            latents: ``[B, …]`` in the denoiser's dtype.
            sigma: ``[B]`` fp32 noise levels (the family turns them into its model's timestep).
            cond: the positive embedding entries of :meth:`encode_prompts` (``[B, …]`` each; extra entries
                are ignored).

        Returns:
            The model output ``[B, …]`` in the layout of ``latents``.
        """

    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """Model output for ``latents [B, …]`` at noise level ``sigma [B]`` (or a scalar), CFG applied inside.

        ``guidance_scale == 1`` runs the conditional branch only. Otherwise the unconditional branch runs on
        the ``negative_*`` embeddings and :meth:`combine_guidance` mixes the two; how depends on ``cfg_mode``:

        * ``split`` (default): the unconditional branch as its own forward under ``torch.no_grad()`` (no
          autograd graph), then the conditional forward; a backward covers ``B`` rows.
        * ``batched``: one forward over ``[uncond; cond]`` (``2B`` rows, as diffusers' pipelines run CFG), the
          unconditional half detached afterwards; a backward runs through all ``2B`` rows.

        Both give the same output and gradients up to float rounding; rollout and training use the same
        mode, so their log-probs agree exactly.

        With ``cudagraph_steps`` (CUDA graphs, ``model.compile_mode=reduce-overhead``) each call without
        gradients (rollout, reference and old-policy scoring) starts a new step of torch's CUDA-graph trees: the
        graphs replayed inside one prediction (both branches, every compiled block) keep their own outputs,
        which the next prediction may overwrite. With gradients the trees start a step after each backward.
        """
        if self.cudagraph_steps and not torch.is_grad_enabled():
            torch.compiler.cudagraph_mark_step_begin()
        x = latents.to(next(self.denoiser.parameters()).dtype)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        if guidance_scale == 1.0:
            return self._forward(x, sigma, cond)
        positive, negative = guidance_branches(cond)
        if self.cfg_mode == "split":
            with torch.no_grad():
                uncond = self._forward(x, sigma, negative)
            return self.combine_guidance(self._forward(x, sigma, positive), uncond, guidance_scale)
        check_cfg_mode(self.cfg_mode)  # batched
        both = {k: torch.cat([negative[k], positive[k]]) for k in positive}
        uncond, conditional = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
        return self.combine_guidance(conditional, uncond.detach(), guidance_scale)

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """CFG of the conditional and (detached) unconditional outputs: ``u + g·(c − u)``. A family with
        another rule (Qwen-Image's norm-rescaled true CFG) overrides it."""
        return uncond + guidance_scale * (cond - uncond)

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, …]`` → float images ``[B, 3, H, W]`` in [0, 1] (video families: frames
        ``[B, F, 3, H, W]``; rewards then score frames, see ``rewards.base.call_reward``)."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Float images ``[B, 3, H, W]`` in [0, 1] → latents (the VAE encoder's mean); offline
        preference pairs need it. Families without an image encoder raise ``ValueError``."""
        raise ValueError(f"model family {type(self).__name__} cannot encode images into latents (no image encoder)")

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """FLOPs of one conditional denoiser forward of one sample at ``height × width`` pixels, with LoRA of
        rank ``lora_rank`` on ``lora_target_modules`` (the convention of ``pipelines.flops``: matmuls,
        convolutions and attention at 2 FLOPs per multiply-add). Families declare their formula by
        overriding this; without one it raises ``ValueError``."""
        raise ValueError(f"model family {type(self).__name__} declares no FLOPs formula (ModelAdapter.forward_flops), so no MFU can be computed for it")

    def prompt_tokens(self) -> int:
        """Text tokens the denoiser attends to per sample: the sequence length of the embedding of the first
        default prompt (``"a photo"`` for a family without default prompts)."""
        first = (self.default_prompts() or ["a photo"])[0]
        if isinstance(first, EditPrompt):
            cond = self.encode([first.instruction], first.source[None].float() / 255.0)
        else:
            cond = self.encode_prompts([first])
        return int(cond["prompt_embeds"].shape[1])

    def compile_decoder(self, backend: str = "inductor") -> bool:
        """``torch.compile`` the image decoder in place (``model.compile_vae``); returns whether anything was compiled.
        Families without a decoder worth compiling (pixel space, or a VAE with per-frame caches) keep this no-op."""
        return False

    def fsdp_blocks(self) -> list[nn.Module]:
        """The denoiser's repeated blocks, each its own FSDP2 unit (transformer blocks; UNet stages)."""
        d = self.denoiser
        blocks = [*getattr(d, "transformer_blocks", []), *getattr(d, "single_transformer_blocks", [])]
        if not blocks and hasattr(d, "down_blocks"):
            blocks = [*d.down_blocks, d.mid_block, *d.up_blocks]
        return blocks

    def default_prompts(self) -> list[str] | list[EditPrompt] | None:
        """The family's built-in prompt set (used when ``trainer.prompts`` is not given), or None; an editing
        family returns :class:`EditPrompt` records."""
        return None

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Sigmas ``[num_steps + 1]`` from 1 to 0 with the family's shift (or ``shift``).

        ``height``/``width`` (pixels) are the image size, for families whose shift depends on it (FLUX's
        dynamic shift); a static-shift family ignores them."""
        return shifted_sigmas(num_steps, self.shift if shift is None else shift)

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device


_PACKAGE_DIR = Path(__file__).resolve().parent
# built-in families whose module is not ``pipelines.<family>``
_FAMILY_MODULES = {"digits_eps": "pipelines.digits.eps"}


def register_family(name: str):
    """Class decorator: make a family buildable by name from config (``model.family=<name>``)."""

    def wrap(cls):
        _FAMILIES[name] = cls
        return cls

    return wrap


def known_families() -> list[str]:
    """Every registered family: each family package of ``pipelines`` (and each module of ``_FAMILY_MODULES``) is
    imported, so a family added as a folder is listed without a list to edit, as are families registered elsewhere."""
    for m in pkgutil.iter_modules([str(_PACKAGE_DIR)]):
        if m.ispkg:
            importlib.import_module(f"pipelines.{m.name}")
    for module in _FAMILY_MODULES.values():
        importlib.import_module(module)
    return sorted(_FAMILIES)


def family_class(family: str) -> type:
    """The adapter class registered as ``family`` (built-in families are imported on first use)."""
    if family not in _FAMILIES:
        # families register on import; import the built-in ones lazily so the core stays model-agnostic
        try:
            importlib.import_module(_FAMILY_MODULES.get(family, f"pipelines.{family}"))
        except ModuleNotFoundError:
            pass
    if family not in _FAMILIES:
        builtin = {m.name for m in pkgutil.iter_modules([str(_PACKAGE_DIR)]) if m.ispkg} | set(_FAMILY_MODULES)
        raise ValueError(f"unknown model family {family!r}; known families: {sorted(builtin | set(_FAMILIES))} (set model.family=…)")
    return _FAMILIES[family]


def hub_patterns(family: str) -> list[str] | None:
    """``allow_patterns`` of a Hub download of ``family``'s weights: its components and ``model_index.json``
    (``None``: the whole repository, for a family that declares no components; ``diffrl.hub.component_patterns``)."""
    return component_patterns(family_class(family).hub_components)


def resolve_model_path(family: str, path: str | None, revision: str | None = None) -> str | None:
    """``model.path`` as a local folder: a local path as it is; a Hub id (``org/name``, ``org/name@rev``) resolved
    through the Hugging Face cache, downloading only the family's components (one-line ``HubError`` when it
    cannot be had, e.g. offline and not cached: it names the repository, the revision and the fetch command)."""
    if path is None:
        return None
    components = family_class(family).hub_components  # an unknown family fails here, before any download
    return str(resolve_model_folder(str(path), components, revision))


def check_adapter_options(family: str, kwargs: Mapping) -> type:
    """Raise a clear error for keyword arguments the family's adapter does not take; return its class."""
    cls = family_class(family)
    kwargs = {k: v for k, v in kwargs.items() if k != "revision"}  # model.revision: consumed by resolve_model_path
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            valid = sorted(k for k in params if k != "self")
            raise ValueError(f"model family {family!r} takes no option(s) {unknown}; its options are {valid} (model.options.<name>=…)")
    if "shape" in kwargs and "shape" in params:  # a published shape (pipelines.shapes): checked before anything is built
        check_shape_path(str(kwargs["shape"]), kwargs.get("path"))
        resolve_shape(family, str(kwargs["shape"]))
    return cls


def build_adapter(family: str, **kwargs) -> ModelAdapter:
    """Build the adapter of ``family`` (``path=None`` builds the family's tiny random configuration; ``path`` may
    be a local diffusers folder or a Hub id, with ``revision``)."""
    cls = check_adapter_options(family, kwargs)
    revision = kwargs.pop("revision", None)
    if kwargs.get("path") is not None:
        kwargs["path"] = resolve_model_path(family, kwargs["path"], revision)
    return cls(**kwargs)


def published_shape(family: str, path=None, shape: str = "tiny") -> str:
    """The published shape (``pipelines.shapes``) a run of ``family`` builds or loads: ``shape`` (``tiny`` for the
    tiny random one, a name or ``full``), else the shape whose Hub repository is ``model.path`` (``org/name``,
    ``@revision`` ignored); ``local`` for a local folder. A Hub id no published shape matches is a one-line error."""
    if path is None:
        spec = resolve_shape(family, shape)
        return "tiny" if spec is None else spec.name
    if Path(str(path)).expanduser().is_dir():
        return "local"
    repo = str(path).split("@")[0].rstrip("/")
    known_families()  # every family's published shapes registered
    for spec in SHAPES.values():
        if spec.family == family and spec.source.split()[0] == repo:
            return spec.name
    known = sorted(s.source.split()[0] for s in SHAPES.values() if s.family == family)
    names = "|".join(["tiny", *sorted(n for n, s in SHAPES.items() if s.family == family)])
    raise ValueError(f"model.path={path} is not a published shape of family {family!r} ({known or 'none'}); plan it with "
                     f"model.path=null +model.options.shape=<{names}>")


def parent_shape_name(shape: str) -> str:
    """An editing model's published shape → its text-to-image parent's (same transformer); any other → itself."""
    known_families()
    return PARENT_SHAPES.get(shape, shape)

