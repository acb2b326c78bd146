"""``hpsv3``: HPSv3 (Ma et al. 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score") on transformers'
Qwen2-VL, without the ``hpsv3`` package (it pins transformers 4.45.2; this project runs transformers 5).

HPSv3 is Qwen2-VL-7B-Instruct with a reward head read at a special token:

* the message: one user turn holding the image (resized by Qwen-VL's ``smart_resize`` to a fixed budget of
  256 × 28 × 28 pixels, bicubic) and the text ``INSTRUCTION.format(text_prompt=prompt) + SUFFIX``, which ends in
  the added special token ``<|Reward|>``; the base model's chat template with the generation prompt, right padding;
* the model: the Qwen2-VL backbone's last hidden states (``model.model``, with HPSv3's positions: 0…L−1 on all
  three M-RoPE axes, image tokens included, as the package runs it), cast to float32, through ``rm_head``
  (``Linear(d, 1024) → ReLU → Dropout(0.05) → Linear(1024, 16) → ReLU → Linear(16, 2)``) at the ``<|Reward|>``
  position: ``(μ, σ)`` of the uncertainty-aware ranking loss. The score is ``μ`` (reported as ``hpsv3``;
  ``hpsv3_sigma`` beside it).

Weights (local paths or Hub ids; left out, the published ones through the Hugging Face cache): ``checkpoint=`` the
released ``HPSv3.safetensors`` (the whole reward model, transformers-4.45 key names, translated by
:func:`convert_keys`; default ``MizzenAI/HPSv3/HPSv3.safetensors``), ``base=`` a Qwen2-VL-7B-Instruct folder for the
config, tokenizer, image processor and chat template (default ``Qwen/Qwen2-VL-7B-Instruct``, without its weights). ``random_init=True`` with ``model_config`` builds a
random (e.g. tiny) model for tests; ``base`` then names a folder holding a processor.

Checked against the ``hpsv3`` package (transformers 4.45.2) on the same tiny random weights, processor and images:
equal μ and σ at the 448² budget, ≤ 1e-6 after resizing (``benchmarks/parity/hpsv3_upstream.py``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from rewards.base import Reward, RewardError, Weights, register_reward
from rewards.clip_models import _dtype

REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28
# HPSv3's training prompt, byte for byte (its data collator): the reward token is read from the trained format
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""  # noqa: W291 - the trailing spaces are part of the trained prompt
SUFFIX = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = PIXELS, max_pixels: int = PIXELS) -> tuple[int, int]:
    """Qwen-VL's resize rule: each side rounded to a multiple of ``factor``, then scaled (aspect kept, sides floored
    or ceiled to ``factor``) into ``[min_pixels, max_pixels]``."""
    if max(height, width) / min(height, width) > 200:
        raise RewardError(f"reward 'hpsv3': image aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def convert_keys(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``HPSv3.safetensors`` → (``Qwen2VLForConditionalGeneration`` state dict in transformers-5 names, ``rm_head``'s).

    transformers 4.45 named the language model ``model.*`` and the vision tower ``visual.*``; transformers 5 nests
    them as ``model.language_model.*`` and ``model.visual.*``. Keys already in the new layout pass unchanged."""
    model, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key[len("rm_head."):]] = value
        elif key.startswith("visual."):
            model["model." + key] = value
        elif key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
            model["model.language_model." + key[len("model."):]] = value
        else:
            model[key] = value
    if not head:
        raise RewardError("reward 'hpsv3': the checkpoint has no rm_head.* weights; is this HPSv3.safetensors?")
    return model, head


class RankNetHead(nn.Sequential):
    """HPSv3's ``rm_head`` ("ranknet"): ``d → 1024 → 16 → 2`` with ReLUs, dropout 0.05 after the first; float32.
    A ``Sequential`` as in the package, so its keys are the checkpoint's ``rm_head.*`` names (``0.weight`` …)."""

    def __init__(self, width: int):
        super().__init__(nn.Linear(width, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(), nn.Linear(16, 2))


@register_reward("hpsv3")
class HPSv3(Reward):
    """HPSv3's preference score μ (module docstring).

    Args:
        checkpoint: local ``HPSv3.safetensors``.
        base: local Qwen2-VL-7B-Instruct folder (config, tokenizer, image processor, chat template).
        random_init: random weights (tests); ``model_config``: ``Qwen2VLConfig`` keyword arguments.
        pixels: the image budget (HPSv3 trains at 256 × 28 × 28).
        device, dtype, batch_size, seed: where and how the model runs (the head runs in float32); the random init's seed.
    """

    hub_weights = {"checkpoint": Weights("MizzenAI/HPSv3/HPSv3.safetensors", "file"), "base": Weights("Qwen/Qwen2-VL-7B-Instruct", "processor")}

    unit = "HPSv3 μ (the preference score; about 0–15 on real images)"
    input = "uint8"
    batch_size = 4

    def __init__(self, checkpoint: str | None = None, base: str | None = None, random_init: bool = False, model_config: dict | None = None,
                 pixels: int = PIXELS, device: str = "cpu", dtype: str = "bfloat16", batch_size: int = 4, seed: int = 0):
        from safetensors.torch import load_file
        from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration

        if batch_size < 1 or pixels < 4 * 28 * 28:
            raise ValueError(f"reward 'hpsv3': batch_size must be ≥ 1 and pixels ≥ {4 * 28 * 28}, got {batch_size}, {pixels}")
        self.device, self.dtype, self.batch_size, self.pixels = device, _dtype(dtype), int(batch_size), int(pixels)
        load = checkpoint is not None or not random_init
        path = self.weights_path("checkpoint", checkpoint, "the HPSv3.safetensors file (MizzenAI/HPSv3)") if load else None
        folder = self.weights_path("base", base, "a Qwen2-VL-7B-Instruct folder (config, tokenizer, processor)")
        self.processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True, padding_side="right")
        tokenizer = self.processor.tokenizer
        if REWARD_TOKEN not in tokenizer.get_vocab():
            tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        self.reward_id = int(tokenizer.convert_tokens_to_ids(REWARD_TOKEN))
        config = Qwen2VLConfig(**model_config) if random_init and model_config is not None else Qwen2VLConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2VLForConditionalGeneration(config)
            model.resize_token_embeddings(len(tokenizer))
            head = RankNetHead(config.text_config.hidden_size)
        if load:
            weights, head_weights = convert_keys(load_file(str(path)))
            missing, unexpected = model.load_state_dict(weights, strict=False)
            if unexpected or [k for k in missing if k != "lm_head.weight"]:
                raise RewardError(f"reward 'hpsv3': {path} does not fit Qwen2-VL at {folder} (missing {missing[:3]}, unexpected {unexpected[:3]})")
            head.load_state_dict(head_weights)
        self.model = model.to(device=device, dtype=self.dtype).eval().requires_grad_(False)
        self.head = head.to(device=device, dtype=torch.float32).eval().requires_grad_(False)

    def inputs(self, images: torch.Tensor, prompts: list[str]):
        """The processor's batch: HPSv3's message per sample, images resized to the budget and scaled to [0, 1]."""
        from PIL import Image

        pictures, messages = [], []
        for image, prompt in zip(images, prompts):
            h, w = smart_resize(int(image.shape[-2]), int(image.shape[-1]), min_pixels=self.pixels, max_pixels=self.pixels)
            pil = Image.fromarray(image.permute(1, 2, 0).cpu().numpy()).resize((w, h), Image.BICUBIC)
            pictures.append(np.asarray(pil, dtype=np.float64) / 255.0)
            messages.append([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION.format(text_prompt=prompt) + SUFFIX}]}])
        texts = [self.processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        return self.processor(text=texts, images=pictures, padding=True, do_rescale=False, return_tensors="pt")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8 or len(prompts) != images.shape[0]:
            raise RewardError(f"reward 'hpsv3': expected uint8 images [B, 3, H, W] and B prompts, got {images.dtype} {tuple(images.shape)} and {len(prompts)}")
        batch = self.inputs(images, prompts).to(self.device)
        at = batch["input_ids"] == self.reward_id
        if not bool((at.sum(dim=1) == 1).all()):
            raise RewardError(f"reward 'hpsv3': each prompt must hold {REWARD_TOKEN} exactly once after templating (a prompt containing it, or truncation?)")
        # HPSv3 runs its backbone on the merged embeddings with no position ids, so transformers 4.45 gives every token,
        # image tokens included, the plain sequential position 0…L−1 on all three M-RoPE axes (not Qwen2-VL's 2-D
        # image positions); the trained reward reads those positions, so they are passed explicitly here
        length = batch["input_ids"].shape[1]
        positions = torch.arange(length, device=self.device).view(1, 1, -1).expand(3, batch["input_ids"].shape[0], -1)
        with torch.no_grad():
            hidden = self.model.model(**batch, position_ids=positions).last_hidden_state
            out = self.head(hidden[at].float())
        return {self.name: out[:, 0].cpu(), f"{self.name}_sigma": out[:, 1].cpu()}


__all__ = ["HPSv3", "INSTRUCTION", "PIXELS", "REWARD_TOKEN", "RankNetHead", "SUFFIX", "convert_keys", "smart_resize"]
