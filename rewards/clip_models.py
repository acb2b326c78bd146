"""CLIP-family rewards: ``clip_score``, ``aesthetic``, ``hpsv2`` (open_clip) and ``pickscore`` (transformers).

Scores (``e_img``, ``e_txt`` are the L2-normalised image and text embeddings of the reward's CLIP):

- ``clip_score`` = ``multiplier · cos(e_img, e_txt)`` ∈ [−multiplier, multiplier]; CLIP ViT-L/14 (OpenAI
  weights, QuickGELU) by default. ``multiplier=1`` (default) gives the cosine; ``multiplier=100`` gives
  torchmetrics' CLIPScore scale (Hessel et al. 2021, "CLIPScore"), without its clamp at 0.
- ``aesthetic`` = ``MLP(e_img)``, the LAION improved aesthetic predictor (``sac+logos+ava1-l14-linearMSE.pth``:
  768→1024→128→64→16→1 linear layers, dropout between the first four, no activations) on the
  normalised CLIP ViT-L/14 image embedding; unbounded, ~1–10 on the AVA scale for the real head.
- ``hpsv2`` = ``cos(e_img, e_txt)`` ∈ [−1, 1] with the HPS v2 / v2.1 fine-tuned open_clip ViT-H-14
  (Wu et al. 2023, "Human Preference Score v2"; its score.py takes the diagonal of
  ``image_features @ text_features.T`` of normalised features).
- ``pickscore`` = ``exp(logit_scale) · cos(e_img, e_txt) / divisor`` ∈ ±exp(logit_scale)/divisor (±100 at the default
  ``divisor=1``; Kirstain et al. 2023, "Pick-a-Pic"): PickScore_v1 is a transformers ``CLIPModel`` (CLIP-H) used with
  the CLIP-ViT-H-14-laion2B processor. ``divisor=26`` is Flow-GRPO's and DiffusionNFT's PickScore scorer ("norm to
  0-1"), which puts PickScore on the scale of the cosine rewards in a sum with them.

Preprocessing (:func:`clip_preprocess`) is the CLIP recipe written in torch for batched uint8 tensors:
bicubic resize of the shorter side to 224 (PIL's antialiased kernel, width then height, each pass rounded
to uint8 as PIL does), centre crop 224×224, ``/255``, normalise with the OpenAI CLIP mean/std. tests/test_reward_zoo.py
checks it against open_clip's and transformers' own image processors on PIL images.

Cosines are clamped to [−1, 1] against float round-off, so outputs stay inside each reward's declared
``scale``. Weights: each option takes a local path or a Hugging Face Hub id (``org/name`` for a folder,
``org/name/<file>`` for one file); left out, it loads the published weights named in the class's
``hub_weights`` through the Hugging Face cache (``diffrl.hub``; ``HF_HUB_OFFLINE=1`` reads the cache only).
``random_init=True`` builds random weights (tests; with ``model_config`` a tiny architecture).
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diffrl.hub import is_hub_ref
from rewards.base import Reward, RewardError, Weights, register_reward

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def clip_preprocess(
    images: torch.Tensor, size: int = 224, crop_size: int | None = None,
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN, std: tuple[float, ...] = OPENAI_CLIP_STD, crop_offset: str = "round",
) -> torch.Tensor:
    """CLIP's eval transform on a batch: shorter side → ``size`` (bicubic), centre crop, normalise.

    Args:
        images: uint8 ``[B, 3, H, W]``.
        size: length of the shorter side after resizing; the longer one is ``int(size · long / short)``
            (torchvision's and transformers' rule).
        crop_size: side of the centre crop (default ``size``).
        mean, std: per-channel normalisation of ``pixel / 255``.
        crop_offset: top/left offset of the crop, ``round((H' − crop) / 2)`` (torchvision's CenterCrop, used
            by open_clip) or ``(H' − crop) // 2`` (transformers' image processors); they differ by one pixel
            when ``H' − crop`` is odd.

    Returns:
        float32 ``[B, 3, crop_size, crop_size]``.
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
        raise ValueError(f"clip_preprocess expects uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    if crop_offset not in ("round", "floor"):
        raise ValueError(f"crop_offset must be 'round' (torchvision, open_clip) or 'floor' (transformers), got {crop_offset!r}")
    crop = crop_size or size
    h, w = images.shape[-2:]
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    x = images.float()
    # PIL's bicubic resize: the antialiased kernel (a = −0.5, support widened when downsampling), first
    # along the width, then along the height, each pass rounded and clipped to uint8
    for pass_size in ((h, new_w), (new_h, new_w)):
        if pass_size != tuple(x.shape[-2:]):
            x = F.interpolate(x, size=pass_size, mode="bicubic", align_corners=False, antialias=True).round().clamp(0, 255)
    if new_h < crop or new_w < crop:
        raise ValueError(f"cannot centre-crop {crop}×{crop} from an image resized to {new_h}×{new_w}; use size ≥ crop_size")
    if crop_offset == "round":
        top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    else:
        top, left = (new_h - crop) // 2, (new_w - crop) // 2
    x = x[..., top : top + crop, left : left + crop] / 255.0
    mean_t = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean_t) / std_t


# the OpenAI CLIP ViT-L/14 weights as an open_clip state dict (clip_score's and the aesthetic predictor's backbone)
OPENAI_VIT_L14 = "timm/vit_large_patch14_clip_224.openai/open_clip_pytorch_model.bin"


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


class _ClipReward(Reward):
    """Shared plumbing: batching, device/dtype, seeded random init. Subclasses define ``embed_images``/``embed_texts``."""

    input = "uint8"
    batch_size = 32

    def _setup(self, device: str, dtype: str, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.device, self.dtype, self.batch_size = device, _dtype(dtype), int(batch_size)

    def _check(self, images: torch.Tensor, prompts: list[str]) -> None:
        if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
            raise ValueError(f"{self.name} reward: expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{self.name} reward: {len(prompts)} prompts for {images.shape[0]} images")

    @torch.no_grad()
    def embeddings(self, images: torch.Tensor, prompts: list[str] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """L2-normalised float32 image embeddings ``[B, D]`` and (with prompts) text embeddings ``[B, D]``."""
        img, txt = [], []
        for start in range(0, images.shape[0], self.batch_size):
            chunk = images[start : start + self.batch_size].to(self.device)
            img.append(F.normalize(self.embed_images(self.preprocess(chunk).to(self.dtype)).float(), dim=-1))
            if prompts is not None:
                txt.append(F.normalize(self.embed_texts(list(prompts[start : start + self.batch_size])).float(), dim=-1))
        return torch.cat(img), (torch.cat(txt) if prompts is not None else None)


def _cosine(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of L2-normalised embeddings, clamped to [−1, 1] (float round-off)."""
    return (img * txt).sum(-1).clamp(-1.0, 1.0)


# -- open_clip -------------------------------------------------------------------------------------
class _OpenClipReward(_ClipReward):
    """An open_clip model from a local state-dict file (``open_clip_pytorch_model.bin``, ``.safetensors``,
    ``HPS_v2_compressed.pt`` …; a ``state_dict`` entry and ``module.`` prefixes are handled by open_clip).

    Args:
        checkpoint: local weights file of the CLIP model.
        model_name: open_clip architecture name (its bundled config and tokenizer).
        random_init: build random weights (tests); ``checkpoint`` is then optional.
        model_config: open_clip config dict (``embed_dim``, ``vision_cfg``, ``text_cfg``, ``quick_gelu``)
            replacing the named architecture (e.g. a tiny one in tests).
        device, dtype, batch_size: where and how the model runs; images per forward.
        seed: seed of the random initialisation.
    """

    default_model = "ViT-L-14-quickgelu"
    weights_hint = "the CLIP ViT-L/14 weights as an open_clip state-dict file (e.g. open_clip_pytorch_model.bin of timm/vit_large_patch14_clip_224.openai)"
    hub_weights = {"checkpoint": Weights(OPENAI_VIT_L14, "file")}

    def __init__(self, checkpoint: str | None = None, model_name: str | None = None, random_init: bool = False,
                 model_config: dict | None = None, device: str = "cpu", dtype: str = "float32", batch_size: int = 32, seed: int = 0):
        import open_clip

        self._setup(device, dtype, batch_size)
        self.model_name = model_name or self.default_model
        path = None if random_init and checkpoint is None else self.weights_path("checkpoint", checkpoint, self.weights_hint)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if model_config is not None:
                model = open_clip.CLIP(**dict(model_config))
            else:
                model = open_clip.create_model(self.model_name, pretrained=None)
        if path is not None:
            try:
                open_clip.load_checkpoint(model, str(path))
            except (RuntimeError, KeyError, ValueError, OSError, StopIteration) as exc:
                raise RewardError(
                    f"reward {self.name!r}: cannot load {path} into open_clip {self.model_name!r} ({type(exc).__name__}: "
                    f"{str(exc)[:300]}); checkpoint must be an open_clip state-dict file (.bin/.pt/.safetensors) of that "
                    "architecture (OpenAI's TorchScript .pt archives are not read: load one once with open_clip.create_model(name, "
                    "pretrained=<file.pt>) and torch.save its state_dict())"
                ) from None
        self.model = model.to(device=device, dtype=self.dtype).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(self.model_name, context_length=self.model.context_length)
        size = self.model.visual.image_size
        self.image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        cfg = getattr(self.model.visual, "preprocess_cfg", {}) or {}
        self.mean = tuple(cfg.get("mean", OPENAI_CLIP_MEAN))
        self.std = tuple(cfg.get("std", OPENAI_CLIP_STD))

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        return clip_preprocess(images, self.image_size, mean=self.mean, std=self.std)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(pixels)

    def embed_texts(self, prompts: list[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(prompts).to(self.device))


@register_reward("clip_score")
class ClipScore(_OpenClipReward):
    """``multiplier · cos(e_img, e_txt)`` with CLIP ViT-L/14 (``multiplier=100``: torchmetrics' scale, no clamp at 0)."""

    unit = "multiplier · cosine similarity, in [−multiplier, multiplier]"

    def __init__(self, *args, multiplier: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        if multiplier <= 0:
            raise ValueError(f"clip_score multiplier must be > 0, got {multiplier}")
        self.multiplier = float(multiplier)
        self.scale = (-self.multiplier, self.multiplier)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        self._check(images, prompts)
        img, txt = self.embeddings(images, prompts)
        return {self.name: self.multiplier * _cosine(img, txt).cpu()}


@register_reward("hpsv2")
class HPSv2(_OpenClipReward):
    """HPS v2: ``cos(e_img, e_txt)`` of the fine-tuned open_clip ViT-H-14 (``checkpoint=HPS_v2_compressed.pt``)."""

    unit = "cosine similarity, in [−1, 1]"
    scale = (-1.0, 1.0)
    default_model = "ViT-H-14"
    weights_hint = "the HPS v2 checkpoint HPS_v2_compressed.pt or HPS_v2.1_compressed.pt (from the xswu/HPSv2 release)"
    hub_weights = {"checkpoint": Weights("xswu/HPSv2/HPS_v2.1_compressed.pt", "file")}

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        self._check(images, prompts)
        img, txt = self.embeddings(images, prompts)
        return {self.name: _cosine(img, txt).cpu()}


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP; parameter names match its ``.pth`` (``layers.{0,2,4,6,7}``)."""

    def __init__(self, input_dim: int = 768):
        super().__init__()
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding)


def _load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state


@register_reward("aesthetic")
class Aesthetic(_OpenClipReward):
    """LAION aesthetic score: ``MLP(e_img)`` on the normalised CLIP ViT-L/14 image embedding (prompts unused).

    Args:
        head_checkpoint: the MLP's weights (``sac+logos+ava1-l14-linearMSE.pth`` or a safetensors copy).
        Other arguments: as :class:`_OpenClipReward` (``checkpoint`` = the CLIP ViT-L/14 weights).
    """

    unit = "LAION aesthetic score (unbounded; ~1–10 for the real head)"
    hub_weights = {"checkpoint": Weights(OPENAI_VIT_L14, "file"),
                   "head_checkpoint": Weights("camenduru/improved-aesthetic-predictor/sac+logos+ava1-l14-linearMSE.pth", "file")}

    def __init__(self, *args, head_checkpoint: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        dim = int(self.model.visual.output_dim)  # the CLIP embedding width (768 for ViT-L/14)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(kwargs.get("seed", 0)) + 1)
            head = AestheticHead(dim)
        random_init = bool(kwargs.get("random_init", False))
        if head_checkpoint is not None or not random_init:
            path = self.weights_path("head_checkpoint", head_checkpoint, "the LAION aesthetic MLP weights (sac+logos+ava1-l14-linearMSE.pth)")
            state = _load_state_dict(path)
            try:
                head.load_state_dict(state)
            except RuntimeError as exc:
                raise RewardError(f"reward 'aesthetic': {path} is not an aesthetic MLP for {dim}-d CLIP embeddings ({exc})") from None
        self.head = head.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        self._check(images, prompts)
        img, _ = self.embeddings(images, None)
        return {self.name: self.head(img.to(self.dtype))[:, 0].float().cpu()}


# -- transformers (PickScore) ----------------------------------------------------------------------
def openai_clip_tokenizer(model_max_length: int = 77):
    """The OpenAI CLIP BPE tokenizer as a transformers ``CLIPTokenizer``, built offline from the BPE
    merges file bundled with open_clip (vocabulary: 256 byte symbols, the same with ``</w>``, the merges,
    then ``<|startoftext|>`` and ``<|endoftext|>`` — 49408 entries)."""
    import open_clip
    from transformers import CLIPTokenizer

    bpe = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = [tuple(line.split()) for line in gzip.open(bpe, "rt", encoding="utf-8").read().split("\n")[1 : 49152 - 256 - 2 + 1]]
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in keep]  # bytes shown as chr(256), chr(257), … (byte-level BPE)
    base = [chr(b) for b in keep] + [chr(256 + n) for n in range(len(unprintable))]  # the byte symbols' vocabulary order
    vocab_list = base + [s + "</w>" for s in base] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab_list)}), encoding="utf-8")
        Path(folder, "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
        return CLIPTokenizer.from_pretrained(folder, model_max_length=model_max_length)


def _features(out: Any) -> torch.Tensor:
    """``get_*_features`` returns a tensor (transformers 4) or an output with ``pooler_output`` (5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _size_field(size: Any, *names: str) -> int:
    """The first of ``names`` set in an image processor's size (an int, a dict or transformers 5's ``SizeDict``)."""
    if isinstance(size, int):
        return size
    for name in names:
        value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
        if value is not None:
            return int(value)
    raise RewardError(f"reward 'pickscore': the image processor's size {size!r} sets none of {names}")


@register_reward("pickscore")
class PickScore(_ClipReward):
    """PickScore: ``exp(logit_scale) · cos(e_img, e_txt)`` of a transformers ``CLIPModel``.

    Args:
        checkpoint: local folder of the CLIPModel (PickScore_v1: ``config.json`` + weights).
        processor: local folder of the CLIP-H processor (tokenizer + ``preprocessor_config.json``, from
            CLIP-ViT-H-14-laion2B-s32B-b79K); default: ``checkpoint``.
        random_init: random weights and the OpenAI CLIP BPE tokenizer (tests).
        model_config: ``CLIPConfig`` keyword arguments (``text_config``, ``vision_config``, ``projection_dim``)
            for a random model (e.g. tiny in tests); default CLIP-H/14.
        device, dtype, batch_size, seed: as the open_clip rewards.
        divisor: the score is divided by it (> 0; 26: Flow-GRPO's and DiffusionNFT's scorer, ~0–1).
    """

    unit = "exp(logit_scale) · cosine similarity / divisor, in ±exp(logit_scale)/divisor (±100 for PickScore_v1 at divisor 1)"
    hub_weights = {"checkpoint": Weights("yuvalkirstain/PickScore_v1", "model"),
                   "processor": Weights("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "processor")}

    def __init__(self, checkpoint: str | None = None, processor: str | None = None, random_init: bool = False,
                 model_config: dict | None = None, device: str = "cpu", dtype: str = "float32", batch_size: int = 32, seed: int = 0,
                 divisor: float = 1.0):
        from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

        if not divisor > 0:
            raise ValueError(f"pickscore divisor must be > 0, got {divisor}")
        self.divisor = float(divisor)

        self._setup(device, dtype, batch_size)
        if random_init and checkpoint is None:
            config = dict(model_config or {
                "text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24, "hidden_act": "gelu"},
                "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16,
                                  "num_hidden_layers": 32, "patch_size": 14, "image_size": 224, "hidden_act": "gelu"},
                "projection_dim": 1024,
            })
            text = {"vocab_size": 49408, "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 49407, **config.pop("text_config", {})}
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = CLIPModel(CLIPConfig(text_config=text, vision_config=config.pop("vision_config", {}), **config))
            self.tokenizer = openai_clip_tokenizer(model.config.text_config.max_position_embeddings)
            image_processor = CLIPImageProcessor(crop_size={"height": model.config.vision_config.image_size, "width": model.config.vision_config.image_size})
        else:
            folder = self.weights_path("checkpoint", checkpoint, "a folder with the PickScore_v1 CLIPModel (config.json + weights)")
            processor = self._processor(checkpoint, processor)
            proc = self.weights_path("processor", processor, "a folder with the CLIP-ViT-H-14-laion2B processor (tokenizer + preprocessor_config.json)")
            model = CLIPModel.from_pretrained(str(folder), local_files_only=True)
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(str(proc), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise RewardError(
                    f"reward 'pickscore': no tokenizer in {proc}; set +reward.options.pickscore.processor=<local folder of "
                    f"laion/CLIP-ViT-H-14-laion2B-s32B-b79K> ({exc})"
                ) from None
            has_config = (proc / "preprocessor_config.json").is_file()
            image_processor = CLIPImageProcessor.from_pretrained(str(proc), local_files_only=True) if has_config else CLIPImageProcessor()
        self.model = model.to(device=device, dtype=self.dtype).eval().requires_grad_(False)
        self.image_size = _size_field(image_processor.size, "shortest_edge", "height")
        self.crop_size = _size_field(image_processor.crop_size, "height")
        self.mean, self.std = tuple(image_processor.image_mean), tuple(image_processor.image_std)
        self.logit_scale = float(self.model.logit_scale.exp().item())
        self.scale = (-self.logit_scale / self.divisor, self.logit_scale / self.divisor)
        self.max_length = min(int(self.tokenizer.model_max_length), int(model.config.text_config.max_position_embeddings))

    @classmethod
    def weight_refs(cls, options: dict) -> dict[str, Weights]:
        refs = super().weight_refs(options)
        processor = cls._processor(options.get("checkpoint"), options.get("processor"))
        if processor is not None and not is_hub_ref(processor):
            refs.pop("processor", None)  # a local folder: nothing to fetch
        return refs

    @staticmethod
    def _processor(checkpoint: str | None, processor: str | None) -> str | None:
        """The processor option in force: the given one; else a local checkpoint folder, which holds model and processor
        together; else ``None`` (the published processor, :attr:`hub_weights`)."""
        if processor is None and checkpoint is not None and not is_hub_ref(checkpoint):
            return checkpoint
        return processor

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        return clip_preprocess(images, self.image_size, self.crop_size, self.mean, self.std, crop_offset="floor")

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        return _features(self.model.get_image_features(pixel_values=pixels))

    def embed_texts(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt").to(self.device)
        return _features(self.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        self._check(images, prompts)
        img, txt = self.embeddings(images, prompts)
        score = self.logit_scale * _cosine(img, txt).cpu()
        return {self.name: score / self.divisor if self.divisor != 1.0 else score}
