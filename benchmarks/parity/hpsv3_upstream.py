"""``hpsv3`` against the ``hpsv3`` package's own score, on the same weights, processor and images.

The package pins transformers 4.45.2 (diffrl runs transformers 5) and builds its model through its training code,
so this check runs it in a side folder and compares in two processes:

    pip install --no-deps --target /tmp/irsite transformers==4.45.2 tokenizers==0.20.3 huggingface_hub==0.26.5
    pip install --no-deps --target /tmp/hpsite hpsv3==1.0.0
    PYTHONPATH=/tmp/hpsite:/tmp/irsite:. python benchmarks/parity/hpsv3_upstream.py upstream --out /tmp/hps   # the package
    PYTHONPATH=. python benchmarks/parity/hpsv3_upstream.py ours --out /tmp/hps                               # diffrl

``upstream`` makes, offline, a Qwen2-VL processor folder (a byte-level BPE trained here on HPSv3's prompt, with
Qwen2's pre-tokenizer and Qwen2-VL's special tokens; Qwen2-VL's image processor at HPSv3's 256 × 28 × 28 budget; Qwen2-VL-Instruct's chat
template) and a tiny random Qwen2-VL (2 layers, width 32) saved beside it. It then runs the package's own path:

1. ``parse_args_with_yaml`` on a config like the package's ``HPSv3_7B.yaml`` (``rm_head_type: ranknet``,
   ``output_dim: 2``, ``use_special_tokens``, ``reward_token: special``), pointed at that folder, float32 on CPU;
2. ``create_model_and_processor``, whose weights it perturbs with seeded noise and writes as ``HPSv3.safetensors``
   (the published file's transformers-4.45 key names);
3. ``HPSv3RewardInferencer(config_path, checkpoint_path)`` and its ``reward(image paths, prompts)`` on seeded PNGs.

The package's training-only imports (trl's trainer, datasets, fire, tensorboard, peft) are replaced by empty
modules; the model, processor and inference code run as shipped. ``ours`` scores the same PNGs and prompts with
``build_reward("hpsv3", checkpoint=…, base=…)`` and writes ``parity.json`` with the largest differences in μ and σ,
and, for scale, the difference μ would have with Qwen2-VL's own M-RoPE image positions (HPSv3 runs its backbone
on merged embeddings without position ids, so every token gets the sequential position on all three axes).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from upstream_parity import main, write_parity

PROMPTS = ["a photo of a red cat", "two dogs on the table", "a blue car left of a green apple", "three apples"]
SIZES = {"448": (448, 448), "320x256": (320, 256)}
PIXELS = 256 * 28 * 28
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (  # Qwen2-VL-Instruct's chat template
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
"""Qwen2's pre-tokenizer pattern (its tokenizer.json), which transformers 5's ``Qwen2TokenizerFast`` also applies"""
CONFIG = """model_name_or_path: "{base}"
rm_head_type: "ranknet"
output_dim: 2
use_special_tokens: true
reward_token: "special"
torch_dtype: "float32"
lora_enable: false
max_pixels: {pixels}
min_pixels: {pixels}
with_instruction: true
output_dir: "{out}"
disable_flash_attn2: true
bf16: false
gradient_checkpointing: false
report_to: "none"
"""


def images(out: Path, seed: int = 0) -> dict[str, list[Path]]:
    """Seeded test images (smooth colour fields with noise) written as PNGs: 448² (the budget itself) and 320×256."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    paths: dict[str, list[Path]] = {}
    for name, (h, w) in SIZES.items():
        base = torch.nn.functional.interpolate(torch.rand(len(PROMPTS), 3, 6, 6, generator=g), size=(h, w), mode="bilinear", align_corners=False)
        batch = ((base * 0.8 + 0.2 * torch.rand(len(PROMPTS), 3, h, w, generator=g)) * 255).round().clamp(0, 255).to(torch.uint8)
        paths[name] = []
        for i, im in enumerate(batch):
            paths[name].append(out / f"image_{name}_{i}.png")
            Image.fromarray(im.permute(1, 2, 0).numpy()).save(paths[name][-1])
    return paths


def _stub_training_imports() -> None:
    """Empty modules for the package's training-only imports (after transformers, whose availability checks must not see them)."""
    import transformers.trainer  # noqa: F401

    class Unused:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("training-only class of the hpsv3 package, stubbed by benchmarks/parity/hpsv3_upstream.py")

    for name, attrs in {"trl": {"RewardTrainer": Unused, "get_kbit_device_map": lambda: None, "get_quantization_config": lambda config: None},
                        "datasets": {}, "fire": {}, "torch.utils.tensorboard": {"SummaryWriter": Unused},
                        "peft": {"PeftModel": Unused, "LoraConfig": Unused, "get_peft_model": Unused}}.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


def upstream(out: Path) -> None:
    _stub_training_imports()
    import hpsv3.inference as inference
    from hpsv3.dataset.data_collator_qwen import INSTRUCTION, prompt_with_special_token
    from hpsv3.train import create_model_and_processor
    from hpsv3.utils.parser import DataConfig, ModelConfig, PEFTLoraConfig, TrainingConfig, parse_args_with_yaml
    from safetensors.torch import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor

    out.mkdir(parents=True, exist_ok=True)
    base = out / "base"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # Qwen2's: split by its regex (digits one by one), then byte-level
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([INSTRUCTION, prompt_with_special_token, "system user assistant You are a helpful assistant.", *PROMPTS], trainer)
    fast = Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=PIXELS, max_pixels=PIXELS), tokenizer=fast, chat_template=TEMPLATE)
    processor.save_pretrained(base)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    config = Qwen2VLConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=len(fast),
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=False, pad_token_id=ids["<|endoftext|>"],
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(base)
    (out / "hpsv3_tiny.yaml").write_text(CONFIG.format(base=base, pixels=PIXELS, out=out / "unused"))

    (data_config, training_args, model_config, peft_config), _ = parse_args_with_yaml(
        (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(out / "hpsv3_tiny.yaml"), is_train=False)
    model, _, _ = create_model_and_processor(model_config=model_config, peft_lora_config=peft_config, training_args=training_args)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.02 if p.ndim > 1 else 0.1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "HPSv3.safetensors"))

    scorer = inference.HPSv3RewardInferencer(config_path=str(out / "hpsv3_tiny.yaml"), checkpoint_path=str(out / "HPSv3.safetensors"), device="cpu")
    result = {"package": "hpsv3 1.0.0 (transformers 4.45.2)", "prompts": PROMPTS, "mu": {}, "sigma": {}}
    for name, paths in images(out).items():
        with torch.no_grad():
            logits = scorer.reward([str(p) for p in paths], PROMPTS)
        result["mu"][name], result["sigma"][name] = logits[:, 0].tolist(), logits[:, 1].tolist()
    result["instruction_matches"] = None  # filled by ``ours``, which holds diffrl's copy
    (out / "instruction.txt").write_text(INSTRUCTION + "\x00" + prompt_with_special_token)
    (out / "upstream.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"mu": result["mu"]}))


def ours(out: Path) -> None:
    import numpy as np
    from PIL import Image

    from rewards.base import build_reward
    from rewards.hpsv3 import INSTRUCTION, SUFFIX

    ref = json.loads((out / "upstream.json").read_text())
    their_instruction, their_suffix = (out / "instruction.txt").read_text().split("\x00")
    reward = build_reward("hpsv3", checkpoint=str(out / "HPSv3.safetensors"), base=str(out / "base"), dtype="float32")
    report = {"prompts": PROMPTS, "instruction_matches": INSTRUCTION == their_instruction, "suffix_matches": SUFFIX == their_suffix}
    batches = {name: torch.stack([torch.from_numpy(np.asarray(Image.open(out / f"image_{name}_{i}.png").convert("RGB"))).permute(2, 0, 1)
                                  for i in range(len(PROMPTS))]) for name in SIZES}
    for name, batch in batches.items():
        mine = reward(batch, PROMPTS)
        mu, sigma = mine["hpsv3"].tolist(), mine["hpsv3_sigma"].tolist()
        report[name] = {"upstream_mu": ref["mu"][name], "diffrl_mu": mu, "max_abs_diff_mu": max(abs(a - b) for a, b in zip(mu, ref["mu"][name])),
                        "max_abs_diff_sigma": max(abs(a - b) for a, b in zip(sigma, ref["sigma"][name])),
                        "mu_spread": max(ref["mu"][name]) - min(ref["mu"][name])}
    # the same score with Qwen2-VL's own M-RoPE image positions (what transformers 5 computes when no position ids
    # are passed; diffrl passes HPSv3's sequential ones): how much the position choice moves μ here
    inputs = reward.inputs(batches["448"], PROMPTS)
    with torch.no_grad():
        hidden = reward.model.model(**inputs).last_hidden_state
        mrope = reward.head(hidden[inputs["input_ids"] == reward.reward_id].float())[:, 0]
    report["448"]["max_abs_diff_mu_with_mrope_positions"] = float((mrope - torch.tensor(ref["mu"]["448"])).abs().max())
    write_parity(out, report)


if __name__ == "__main__":
    main(__doc__, upstream, ours)
