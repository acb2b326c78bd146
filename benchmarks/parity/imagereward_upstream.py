"""``imagereward`` against the ``image-reward`` package's own score, on the same weights and images.

The package pins timm 0.6.13 and an old transformers (its BLIP code imports transformers 4 internals), so it
cannot be installed beside diffrl; this check runs it in a side folder and compares in two processes:

    pip install --no-deps --target /tmp/irsite transformers==4.45.2 tokenizers==0.20.3 huggingface_hub==0.26.5 \\
        timm==0.6.13 image-reward==1.5
    PYTHONPATH=/tmp/irsite:. python benchmarks/parity/imagereward_upstream.py upstream --out /tmp/ir   # the package
    PYTHONPATH=. python benchmarks/parity/imagereward_upstream.py ours --out /tmp/ir                   # diffrl

``upstream`` builds the package's ``ImageReward`` at its published architecture (BLIP ViT-L/16 at 224 px +
BERT-base with cross-attention, ``med_config`` vocabulary 30524) with seeded random weights, perturbed so that
LayerNorms and biases are not at their initial values. It writes them as ``ImageReward.pt`` (the package's own
state-dict key names, as the published file has them), a small WordPiece vocabulary (the package would fetch
bert-base-uncased's; both sides read this one), seeded test images, and the package's ``score(prompt, PIL
image)`` for each. fairscale (a pin of the package used only for activation checkpointing, off at inference) is
replaced by a pass-through, and the package's ``__init__`` files, which import its training code and other scores
(datasets, accelerate, OpenAI's clip), are skipped. ``ours`` loads the same file with ``build_reward("imagereward", checkpoint=…,
tokenizer=…)``, scores the same images and prompts, and writes ``parity.json`` with the largest difference.
Images are 224×224, which both preprocessings leave unresized. Other sizes differ by design: the package
resizes PIL images with PIL's bicubic filter, diffrl resizes tensors with torch's. Those differences are reported
separately, not asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from upstream_parity import main, write_parity

WORDS = ["a", "photo", "of", "red", "blue", "green", "cat", "dog", "car", "two", "three", "on", "the", "table", "left", "apple", "##s"]
PROMPTS = ["a photo of a red cat", "two dogs on the table", "a blue car left of a green apple", "three apples"]
MED_CONFIG = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
              "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
              "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 30524,
              "encoder_width": 768, "add_cross_attention": True}


def images(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded uint8 test images: smooth colour fields with noise, at 224 px (parity) and 320×256 (resize)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (h, w) in {"224": (224, 224), "320x256": (320, 256)}.items():
        base = torch.nn.functional.interpolate(torch.rand(len(PROMPTS), 3, 6, 6, generator=g), size=(h, w), mode="bilinear", align_corners=False)
        out[name] = ((base * 0.8 + 0.2 * torch.rand(len(PROMPTS), 3, h, w, generator=g)) * 255).round().clamp(0, 255).to(torch.uint8)
    return out


def upstream(out: Path) -> None:
    from PIL import Image

    stub = types.ModuleType("fairscale.nn.checkpoint.checkpoint_activations")
    stub.checkpoint_wrapper = lambda module, *a, **k: module
    for name in ("fairscale", "fairscale.nn", "fairscale.nn.checkpoint"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[stub.__name__] = stub
    # the package's __init__ files import its training code (datasets, accelerate) and its other scores (OpenAI's
    # clip): bare package modules let the BLIP and ImageReward modules load alone
    root = Path(importlib.util.find_spec("ImageReward").submodule_search_locations[0])
    for name in ("ImageReward", "ImageReward.models"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    import ImageReward.models.BLIP.blip_pretrain as blip_pretrain
    from ImageReward.ImageReward import ImageReward
    from transformers import BertTokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(exist_ok=True)
    (out / "tokenizer" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    (out / "med_config.json").write_text(json.dumps(MED_CONFIG))

    def local_tokenizer():  # the package's init_tokenizer, on the local vocabulary
        tok = BertTokenizer(str(out / "tokenizer" / "vocab.txt"))
        tok.add_special_tokens({"bos_token": "[DEC]"})
        tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        tok.enc_token_id = tok.additional_special_tokens_ids[0]
        return tok

    blip_pretrain.init_tokenizer = local_tokenizer
    torch.manual_seed(0)
    model = ImageReward(med_config=str(out / "med_config.json"), device="cpu").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.02 if p.ndim > 1 else 0.1))
    torch.save(model.state_dict(), out / "ImageReward.pt")
    result = {"package": "image-reward 1.5", "prompts": PROMPTS, "scores": {}}
    for name, batch in images().items():
        torch.save(batch, out / f"images_{name}.pt")
        with torch.no_grad():
            result["scores"][name] = [float(model.score(p, Image.fromarray(im.permute(1, 2, 0).numpy()))) for p, im in zip(PROMPTS, batch)]
    (out / "upstream.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["scores"]))


def ours(out: Path) -> None:
    from rewards.base import build_reward

    reward = build_reward("imagereward", checkpoint=str(out / "ImageReward.pt"), tokenizer=str(out / "tokenizer"))
    ref = json.loads((out / "upstream.json").read_text())
    report = {"prompts": PROMPTS}
    for name, theirs in ref["scores"].items():
        mine = reward(torch.load(out / f"images_{name}.pt", weights_only=True), PROMPTS)["imagereward"].tolist()
        diff = max(abs(a - b) for a, b in zip(mine, theirs))
        report[name] = {"upstream": theirs, "diffrl": mine, "max_abs_diff": diff, "score_spread": max(theirs) - min(theirs)}
    write_parity(out, report)


if __name__ == "__main__":
    main(__doc__, upstream, ours)
