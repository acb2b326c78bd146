"""Tiny random configurations shared by the families' offline test builds (no weights, no downloads).

Tokenizers are built in code (a byte-level CLIP tokenizer, a character-level T5 tokenizer); the text
encoders and the VAE are seeded random modules small enough for CPU tests. The editing families' built-in
prompts are synthetic: seeded coloured shapes on plain backgrounds with colour instructions
(:func:`tiny_edit_prompts`).
"""

from __future__ import annotations

import torch

from pipelines.base import EditPrompt

# the prompt set of the tiny configurations (``default_prompts`` of sd15, sd3, flux, …)
TINY_PROMPTS = ["a cat", "a dog", "a horse", "a rabbit", "a monkey", "a bird", "a fish", "a lion"]

# CLIP-L / CLIP-G of width 32 (SD3 concatenates two: 64) and a T5 of width 80
TINY_CLIP = dict(
    bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
    num_hidden_layers=2, vocab_size=600, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
)
TINY_T5 = dict(
    d_model=80, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    feed_forward_proj="relu", dropout_rate=0.0,
)
# an AutoencoderKL with VAE factor 2 (SD3 and FLUX; each family sets its own shift/scaling factors)
TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), layers_per_block=1,
    latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
)


def _byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for the bytes 0…255 (GPT-2's mapping)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_tiny_tokenizer(max_length: int = 16):
    """A CLIP tokenizer over single bytes (no merges), built offline: 2 specials + 256 + 256 ``</w>`` symbols,
    padding to ``max_length`` tokens (16 in the tiny configurations, CLIP's 77 at published shapes)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for symbol in _byte_symbols():
        vocab[symbol] = len(vocab)
    for symbol in _byte_symbols():
        vocab[symbol + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def build_tiny_t5_tokenizer(max_length: int = 16):
    """An offline T5 tokenizer (``T5TokenizerFast`` over a character-level Unigram model built in code):
    ids 0 ``<pad>``, 1 ``</s>``, 2 ``<unk>``, then ``▁`` and printable ASCII (bare and word-initial), with
    T5's post-processing (``</s>`` appended)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("▁" + c, -2.5) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0, model_max_length=max_length,
    )


def build_tiny_vae(seed: int, **norm):
    """The tiny ``AutoencoderKL`` (:data:`TINY_VAE`), seeded, with the family's ``shift_factor``/``scaling_factor``."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**TINY_VAE, **norm)


def build_tiny_t5(seed: int, vocab_size: int):
    """The tiny T5 encoder (:data:`TINY_T5`), seeded."""
    from transformers import T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T5EncoderModel(T5Config(vocab_size=vocab_size, **TINY_T5))


# the editing families' built-in prompts: (instruction, shape, shape colour, background colour) per source
TINY_EDIT_COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
    "white": (245, 245, 245), "black": (15, 15, 15), "grey": (128, 128, 128),
}
TINY_EDITS = [
    ("make it blue", "disc", "red", "white"), ("make it red", "square", "green", "grey"),
    ("make the background black", "diamond", "yellow", "white"), ("make it green", "disc", "blue", "yellow"),
    ("make it yellow", "square", "red", "black"), ("make the background white", "disc", "green", "black"),
    ("make it white", "diamond", "blue", "grey"), ("make it red", "disc", "yellow", "blue"),
]


def synthetic_source(shape: str, colour: str, background: str, size: int, generator: torch.Generator) -> torch.Tensor:
    """A uint8 ``[3, size, size]`` image: one ``disc``, ``square`` or ``diamond`` of ``colour`` on ``background``,
    its centre and radius (a quarter to a third of the side) drawn from ``generator``."""
    radius = size * (0.25 + 0.08 * float(torch.rand((), generator=generator)))
    cy, cx = (size / 2 + (torch.rand(2, generator=generator) - 0.5) * (size - 2 * radius)).tolist()
    y, x = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dy, dx = (y - cy).abs(), (x - cx).abs()
    inside = {"disc": dy**2 + dx**2 <= radius**2, "square": torch.maximum(dy, dx) <= radius * 0.8, "diamond": dy + dx <= radius * 1.2}[shape]
    image = torch.tensor(TINY_EDIT_COLOURS[background], dtype=torch.uint8).view(3, 1, 1).repeat(1, size, size)
    image[:, inside] = torch.tensor(TINY_EDIT_COLOURS[colour], dtype=torch.uint8).view(3, 1)
    return image


def tiny_edit_prompts(size: int = 32, seed: int = 0) -> list[EditPrompt]:
    """The editing families' built-in prompts (:data:`TINY_EDITS`): an instruction and a seeded synthetic source
    (:func:`synthetic_source`, ``size × size``) each; the same ``seed`` gives the same images."""
    generator = torch.Generator().manual_seed(seed)
    return [
        EditPrompt(instruction, synthetic_source(shape, colour, background, size, generator), name=f"{colour} {shape} on {background}")
        for instruction, shape, colour, background in TINY_EDITS
    ]
