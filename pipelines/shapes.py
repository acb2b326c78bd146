"""Published model shapes with random weights, built directly on the target device in the target dtype.

``model.options.shape`` picks what a family builds when ``model.path`` is null:

* ``tiny`` (the default): the small random configuration of the tests.
* a published shape by name (:data:`SHAPES`, registered by each family's module with :func:`register_shape`), or
  ``full`` for the family's flagship (:data:`FULL`): the
  transformer and the VAE at their published diffusers configs, with random weights, so recipes, benchmarks
  and tests run at real shape on any GPU without downloading anything. Real weights still come from
  ``model.path``.

Building happens under :func:`building`: ``torch.device(device)`` and the target default dtype, so a 20 B
transformer is allocated once, on the GPU, in bf16 (no 80 GB fp32 detour through host memory), and on
``device="meta"`` it allocates nothing at all (parameter counts, FLOP counting).

The text encoders of a published shape are the family's published ones at their published configs (CLIP-L,
OpenCLIP bigG's text tower, T5-XXL's and UMT5-XXL's encoders, Qwen2.5-VL-7B with its vision tower: :data:`TEXT_ENCODERS`),
random, over small offline tokenizers whose ids fall inside the published vocabularies, so that a plan or a benchmark
holds what a real run holds (about 10 GiB of bf16 text encoders beside SD3.5 and FLUX.1, 15 GiB beside Qwen-Image)
until ``drop_text_encoders`` frees them. ``Shape.stand_in_text=True`` builds 2-layer stand-ins of the real output
widths and token counts instead (CLIP-L 768, CLIP-G 1280, T5/UMT5 4096, Qwen2.5-VL 3584): tests that run a
published shape's text side on a CPU. A real run loads the real encoders from ``model.path``.

Transformer parameters (counted on ``meta``, ``tests/test_shapes.py``): Qwen-Image (and Qwen-Image-Edit) 20.43 B,
Wan2.1-T2V-14B 14.29 B, FLUX.1-dev (and FLUX.1-Kontext-dev) 11.90 B, SD3.5-Large 8.06 B, SD3.5-Medium 2.24 B,
Wan2.1-T2V-1.3B 1.42 B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass, field

import torch

# AutoencoderKL of SD3 / SD3.5 and FLUX.1 (diffusers' vae/config.json of both): factor 8, 16 channels
SD3_FLUX_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
    use_quant_conv=False, use_post_quant_conv=False,
)


# The published text encoders (transformers config keyword arguments of their published config.json). Token ids are left to
# the builders: they come from the small offline tokenizers, whose ids fall inside these vocabularies.
CLIP_L_TEXT = dict(  # stabilityai/stable-diffusion-3.5-medium text_encoder/config.json = openai/clip-vit-large-patch14's text model
    hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, vocab_size=49408, max_position_embeddings=77,
    projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5,
)
CLIP_G_TEXT = dict(  # stabilityai/stable-diffusion-3.5-medium text_encoder_2/config.json = laion/CLIP-ViT-bigG-14's text model
    hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32, vocab_size=49408, max_position_embeddings=77,
    projection_dim=1280, hidden_act="gelu", layer_norm_eps=1e-5,
)
T5_XXL_ENCODER = dict(  # stabilityai/stable-diffusion-3.5-medium text_encoder_3/config.json, FLUX.1-dev text_encoder_2 = google/t5-v1_1-xxl
    d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, vocab_size=32128, feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32, relative_attention_max_distance=128, layer_norm_epsilon=1e-6, dropout_rate=0.0,
)
UMT5_XXL_ENCODER = dict(T5_XXL_ENCODER, vocab_size=256384)  # Wan-AI/Wan2.1-T2V-14B-Diffusers text_encoder/config.json = google/umt5-xxl
QWEN2_5_VL_7B = dict(  # Qwen/Qwen-Image text_encoder/config.json = Qwen/Qwen2.5-VL-7B-Instruct (its vision tower and lm_head included)
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
              vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], in_chans=3),
)
TEXT_ENCODERS = {"clip_l": CLIP_L_TEXT, "clip_g": CLIP_G_TEXT, "t5": T5_XXL_ENCODER, "umt5": UMT5_XXL_ENCODER, "qwen2_5_vl": QWEN2_5_VL_7B}
"""the text encoders of the published shapes by the key their ``text_widths`` names them with"""
TEXT_ENCODER_PARAMS = {"clip_l": 123_650_304, "clip_l_unprojected": 123_060_480, "clip_g": 694_659_840, "t5": 4_762_310_656,
                       "umt5": 5_680_910_336, "qwen2_5_vl": 8_292_166_656}
"""their parameters, counted on ``meta`` from :data:`TEXT_ENCODERS` (``tests/test_plan.py``): CLIP-L with its projection (SD3) and
without (FLUX.1's ``CLIPTextModel``), CLIP-G with its projection, the T5-XXL and UMT5-XXL encoders, Qwen2.5-VL-7B whole"""


@dataclass(frozen=True)
class Shape:
    """A published model: the family, the transformer's and the VAE's diffusers configs, its text encoders (a key
    of :data:`TEXT_ENCODERS` → their output width) and the T5-style sequence length the family's pipeline pads to."""

    name: str
    family: str
    transformer: dict
    vae: dict
    text_widths: dict = field(default_factory=dict)
    max_sequence_length: int = 512
    params_billion: float = 0.0
    source: str = ""
    stand_in_text: bool = False
    """True: 2-layer text encoders of the real widths (tests on a CPU); False: the published configs (:data:`TEXT_ENCODERS`)"""

    def block_kinds(self) -> dict[str, int]:
        """:func:`block_kinds` of this shape."""
        return block_kinds(self)

    def with_depth(self, counts: dict[str, int]) -> Shape:
        """:func:`with_depth` of this shape."""
        return with_depth(self, counts)


SHAPES: dict[str, Shape] = {}
"""Every registered published shape by name (:func:`register_shape`; each family registers its own on import)."""
PARENT_SHAPES: dict[str, str] = {}
"""an editing model's published shape → its text-to-image parent's (the same transformer and VAE configs): the editing
adapters build through their parent's builder"""
FULL: dict[str, str] = {}
"""``shape=full``: each family's flagship"""


def register_shape(shape: Shape, *, full: bool = False, parent: str | None = None) -> Shape:
    """Make ``shape`` a published shape of its family (``model.options.shape=<name>``): a family's module registers its
    own on import. ``full``: the family's flagship (``shape=full``); ``parent``: an editing model's text-to-image
    parent shape, whose builder it uses."""
    if shape.name in SHAPES and SHAPES[shape.name] != shape:
        raise ValueError(f"published shape {shape.name!r} is registered twice, differently")
    SHAPES[shape.name] = shape
    if full:
        FULL[shape.family] = shape.name
    if parent is not None:
        PARENT_SHAPES[shape.name] = parent
    return shape


def _family_loaded(family: str) -> None:
    """Import ``pipelines.<family>`` so that its shapes are registered (a family elsewhere registers them itself)."""
    if not any(s.family == family for s in SHAPES.values()):
        try:
            importlib.import_module(f"pipelines.{family}")
        except ModuleNotFoundError:
            pass


def shape_names(family: str) -> list[str]:
    """The values ``model.options.shape`` takes for ``family``."""
    _family_loaded(family)
    return ["tiny", *(["full"] if family in FULL else []), *sorted(n for n, s in SHAPES.items() if s.family == family)]


def resolve_shape(family: str, shape: str) -> Shape | None:
    """The published shape ``shape`` of ``family`` (None for ``tiny``); a one-line error names the valid ones."""
    if shape == "tiny":
        return None
    _family_loaded(family)
    name = FULL.get(family) if shape == "full" else shape
    found = SHAPES.get(name or "")
    if found is None or found.family != family:
        raise ValueError(f"model family {family!r} has no shape {shape!r}; its shapes are {shape_names(family)} (model.options.shape=…)")
    return found


def check_shape_path(shape: str, path) -> None:
    """A published shape builds random weights: refuse it next to ``model.path`` (which would be ignored)."""
    if shape != "tiny" and path is not None:
        raise ValueError(f"model.options.shape={shape} builds random weights at a published shape and model.path={path} loads real ones; give one of them")


def family_components(family: str, *, path, shape: str, seed: int, device: str, dtype: str, load, tiny, build) -> dict:
    """A family's components: ``load(path)`` when ``model.path`` is given, else ``tiny(seed)`` for ``shape=tiny`` or
    ``build(seed, Shape, device, dtype)`` for a published shape (checked first: one clear error names the valid ones)."""
    check_shape_path(shape, path)
    spec = resolve_shape(family, shape)
    if path is not None:
        return load(path)
    return tiny(seed) if spec is None else build(seed, spec, device, dtype)


def parent_shape(family: str, shape: str) -> str:
    """The shape name under which an editing ``family``'s text-to-image parent builds ``shape``: ``tiny`` stays
    ``tiny``, a published editing shape (or ``full``) maps through :data:`PARENT_SHAPES`."""
    spec = resolve_shape(family, shape)
    return "tiny" if spec is None else PARENT_SHAPES[spec.name]


def plain(config: dict) -> dict:
    """A config with tuples as lists (the diffusers VAE classes take lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


@contextlib.contextmanager
def building(device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32", seed: int | None = None):
    """Construct modules directly on ``device`` in ``dtype`` (torch's device context and default dtype), with the
    global RNG seeded by ``seed`` and restored afterwards (CUDA's too when building there)."""
    dtype_ = dtype if isinstance(dtype, torch.dtype) else {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    previous = torch.get_default_dtype()
    on_cuda = torch.device(device).type == "cuda"
    with torch.random.fork_rng(devices=[torch.device(device)] if on_cuda else []), torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        torch.set_default_dtype(dtype_)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def clip_config(base: dict, width: int) -> dict:
    """A CLIP text config of ``base`` widened to hidden size and projection ``width`` (heads of 64): the stand-in."""
    return dict(base, hidden_size=width, projection_dim=width, intermediate_size=width, num_attention_heads=max(1, width // 64))


def t5_config(base: dict, width: int) -> dict:
    """A T5/UMT5 encoder config of ``base`` with model width ``width`` (8 heads of 64, feed-forward 1024): the stand-in."""
    return dict(base, d_model=width, d_kv=64, num_heads=8, d_ff=1024)


def block_kinds(shape: Shape) -> dict[str, int]:
    """The transformer's repeated blocks of ``shape`` by kind → how many: FLUX's ``double`` and ``single`` blocks, SD3's
    ``dual`` (dual-attention, the first ones), ``plain`` and ``last`` (context-pre-only) blocks, any other family's
    ``block``s. A plan traces a few of each kind and multiplies (``diffrl.tools.plan``; :func:`with_depth` builds them)."""
    t = shape.transformer
    if "num_single_layers" in t:
        return {"double": int(t["num_layers"]), "single": int(t["num_single_layers"])}
    if "caption_projection_dim" in t:  # SD3's MMDiT
        dual = tuple(t.get("dual_attention_layers", ()))
        if dual != tuple(range(len(dual))):
            raise ValueError(f"shape {shape.name}: dual-attention blocks {dual} are not the first ones")
        return {"dual": len(dual), "plain": int(t["num_layers"]) - len(dual) - 1, "last": 1}
    return {"block": int(t["num_layers"])}


def with_depth(shape: Shape, counts: dict[str, int]) -> Shape:
    """``shape`` with ``counts`` blocks of each kind of :func:`block_kinds` (the rest of it unchanged)."""
    t = dict(shape.transformer)
    if "num_single_layers" in t:
        t.update(num_layers=counts["double"], num_single_layers=counts["single"])
    elif "caption_projection_dim" in t:
        t["num_layers"] = counts["dual"] + counts["plain"] + counts["last"]
        if "dual_attention_layers" in t:
            t["dual_attention_layers"] = tuple(range(counts["dual"]))
    else:
        t["num_layers"] = counts["block"]
    return dataclasses.replace(shape, transformer=t)


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def text_config(shape: Shape, name: str, tiny: dict, vocab_size: int | None = None) -> dict:
    """The config keyword arguments of ``shape``'s text encoder ``name`` (``clip_l``, ``clip_g``, ``t5``, ``umt5``): the
    published one (:data:`TEXT_ENCODERS`) with the token ids of ``tiny`` (the tiny config of the offline tokenizer
    the shape is built with); with ``shape.stand_in_text`` the 2-layer stand-in of the published width over ``tiny``
    (``vocab_size``: the tokenizer's). A tokenizer larger than the published vocabulary is an error."""
    width = shape.text_widths[name]
    if shape.stand_in_text:
        config = clip_config(tiny, width) if name.startswith("clip") else t5_config(tiny, width)
        return config if vocab_size is None else dict(config, vocab_size=vocab_size)
    published = TEXT_ENCODERS[name]
    if vocab_size is not None and vocab_size > published["vocab_size"]:
        raise ValueError(f"a tokenizer of {vocab_size} ids does not fit {name}'s published vocabulary of {published['vocab_size']}")
    return {**published, **{k: tiny[k] for k in _TOKEN_IDS if k in tiny}}


__all__ = [
    "FULL", "PARENT_SHAPES", "SHAPES", "SD3_FLUX_VAE", "Shape", "building", "check_shape_path", "clip_config", "family_components", "parent_shape",
    "plain", "register_shape", "resolve_shape", "shape_names", "t5_config", "text_config", "TEXT_ENCODERS", "TEXT_ENCODER_PARAMS",
    "block_kinds", "with_depth", "CLIP_L_TEXT", "CLIP_G_TEXT", "T5_XXL_ENCODER", "UMT5_XXL_ENCODER", "QWEN2_5_VL_7B",
]
