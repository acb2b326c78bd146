"""``imagereward`` on transformers' BLIP modules: a state dict in ImageReward.pt's own key names (BLIP's ViT and
BERT) loads through ``convert_state_dict`` and scores exactly as a plain-torch transcription of BLIP's forward on
those keys (ViT blocks, BERT layers with cross-attention, the [CLS] → MLP head, the standardisation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffrl.hub import HubError
from rewards.base import RewardError, build_reward
from rewards.clip_models import clip_preprocess
from rewards.image_reward import MAX_LENGTH, MEAN, STD, ImageReward, convert_state_dict

WORDS = ["a", "red", "blue", "seven", "two", "photo", "of", "cat", "dog", "the"]
V = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=16)
T = dict(vocab_size=5 + len(WORDS), hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=40)
PROMPTS = ["a red seven", "a photo of the blue dog", "two cat"]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert_vocab")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return folder


def _checkpoint(path) -> dict[str, torch.Tensor]:
    """Random weights under ImageReward.pt's key names, plus keys the score does not use."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    D, Dt, P = V["hidden_size"], T["hidden_size"], V["patch_size"]
    sd = {"blip.visual_encoder.cls_token": r(1, 1, D), "blip.visual_encoder.pos_embed": r(1, (V["image_size"] // P) ** 2 + 1, D),
          "blip.visual_encoder.patch_embed.proj.weight": r(D, 3, P, P), "blip.visual_encoder.patch_embed.proj.bias": r(D),
          "blip.visual_encoder.norm.weight": 1 + r(D), "blip.visual_encoder.norm.bias": r(D)}
    for i in range(V["num_hidden_layers"]):
        b = f"blip.visual_encoder.blocks.{i}."
        sd.update({b + "norm1.weight": 1 + r(D), b + "norm1.bias": r(D), b + "attn.qkv.weight": r(3 * D, D), b + "attn.qkv.bias": r(3 * D),
                   b + "attn.proj.weight": r(D, D), b + "attn.proj.bias": r(D), b + "norm2.weight": 1 + r(D), b + "norm2.bias": r(D),
                   b + "mlp.fc1.weight": r(V["intermediate_size"], D), b + "mlp.fc1.bias": r(V["intermediate_size"]),
                   b + "mlp.fc2.weight": r(D, V["intermediate_size"]), b + "mlp.fc2.bias": r(D)})
    t = "blip.text_encoder."
    sd.update({t + "embeddings.word_embeddings.weight": r(T["vocab_size"], Dt), t + "embeddings.position_embeddings.weight": r(T["max_position_embeddings"], Dt),
               t + "embeddings.LayerNorm.weight": 1 + r(Dt), t + "embeddings.LayerNorm.bias": r(Dt),
               t + "embeddings.position_ids": torch.arange(T["max_position_embeddings"])[None]})
    for i in range(T["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for part, width in (("attention", Dt), ("crossattention", D)):
            sd.update({b + f"{part}.self.query.weight": r(Dt, Dt), b + f"{part}.self.query.bias": r(Dt),
                       b + f"{part}.self.key.weight": r(Dt, width), b + f"{part}.self.key.bias": r(Dt),
                       b + f"{part}.self.value.weight": r(Dt, width), b + f"{part}.self.value.bias": r(Dt),
                       b + f"{part}.output.dense.weight": r(Dt, Dt), b + f"{part}.output.dense.bias": r(Dt),
                       b + f"{part}.output.LayerNorm.weight": 1 + r(Dt), b + f"{part}.output.LayerNorm.bias": r(Dt)})
        sd.update({b + "intermediate.dense.weight": r(T["intermediate_size"], Dt), b + "intermediate.dense.bias": r(T["intermediate_size"]),
                   b + "output.dense.weight": r(Dt, T["intermediate_size"]), b + "output.dense.bias": r(Dt),
                   b + "output.LayerNorm.weight": 1 + r(Dt), b + "output.LayerNorm.bias": r(Dt)})
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, Dt), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"] = r(o, n) * 0.5, r(o)
    sd.update({"blip.vision_proj.weight": r(4, D), "blip.text_decoder.bert.embeddings.word_embeddings.weight": r(3, Dt), "blip.visual_encoder_m.cls_token": r(1, 1, D)})
    torch.save(sd, path)
    return sd


def _attention(x, ctx, sd, p, heads, mask=None):
    B, N, D = x.shape
    q = F.linear(x, sd[p + "query.weight"], sd[p + "query.bias"]).view(B, N, heads, -1).transpose(1, 2)
    k = F.linear(ctx, sd[p + "key.weight"], sd[p + "key.bias"]).view(B, ctx.shape[1], heads, -1).transpose(1, 2)
    v = F.linear(ctx, sd[p + "value.weight"], sd[p + "value.bias"]).view(B, ctx.shape[1], heads, -1).transpose(1, 2)
    a = q @ k.transpose(-1, -2) / (D // heads) ** 0.5
    if mask is not None:
        a = a + (1.0 - mask[:, None, None, :].float()) * -10000.0
    return (a.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D)


def reference_score(sd, pixels, ids, mask) -> torch.Tensor:
    """BLIP's ViT + BERT-with-cross-attention + ImageReward's head, written out on ImageReward.pt's key names."""
    p, D, H = "blip.visual_encoder.", V["hidden_size"], V["num_attention_heads"]
    x = F.conv2d(pixels, sd[p + "patch_embed.proj.weight"], sd[p + "patch_embed.proj.bias"], stride=V["patch_size"]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[p + "cls_token"].expand(x.shape[0], -1, -1), x], dim=1) + sd[p + "pos_embed"]
    for i in range(V["num_hidden_layers"]):
        b = f"{p}blocks.{i}."
        h = F.layer_norm(x, (D,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], 1e-6)
        B, N, _ = h.shape
        q, k, v = F.linear(h, sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]).view(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
        h = ((q @ k.transpose(-1, -2) * (D // H) ** -0.5).softmax(-1) @ v).transpose(1, 2).reshape(B, N, D)
        x = x + F.linear(h, sd[b + "attn.proj.weight"], sd[b + "attn.proj.bias"])
        h = F.layer_norm(x, (D,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], 1e-6)
        x = x + F.linear(F.gelu(F.linear(h, sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"])), sd[b + "mlp.fc2.weight"], sd[b + "mlp.fc2.bias"])
    image = F.layer_norm(x, (D,), sd[p + "norm.weight"], sd[p + "norm.bias"], 1e-6)
    t, Dt, Ht = "blip.text_encoder.", T["hidden_size"], T["num_attention_heads"]
    ln = lambda z, k: F.layer_norm(z, (Dt,), sd[k + ".weight"], sd[k + ".bias"], 1e-12)  # noqa: E731
    x = ln(sd[t + "embeddings.word_embeddings.weight"][ids] + sd[t + "embeddings.position_embeddings.weight"][: ids.shape[1]], t + "embeddings.LayerNorm")
    for i in range(T["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for part, ctx, m in (("attention", None, mask), ("crossattention", image, None)):
            a = _attention(x, x if ctx is None else ctx, sd, b + part + ".self.", Ht, m)
            x = ln(x + F.linear(a, sd[b + part + ".output.dense.weight"], sd[b + part + ".output.dense.bias"]), b + part + ".output.LayerNorm")
        h = F.gelu(F.linear(x, sd[b + "intermediate.dense.weight"], sd[b + "intermediate.dense.bias"]))
        x = ln(x + F.linear(h, sd[b + "output.dense.weight"], sd[b + "output.dense.bias"]), b + "output.LayerNorm")
    r = x[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = F.linear(r, sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"])
    return (r.squeeze(-1) - MEAN) / STD


def test_imagereward_checkpoint_scores_like_blips_own_forward(vocab, tmp_path):
    sd = _checkpoint(tmp_path / "ImageReward.pt")
    reward = build_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(vocab), vision_config=V, text_config=T)
    images = torch.randint(0, 256, (3, 3, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = reward(images, PROMPTS)["imagereward"]
    tokens = reward.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    assert tokens["input_ids"].shape == (3, 35) and tokens["input_ids"][0, :5].tolist() == [2, 5, 6, 8, 3]  # [CLS] a red seven [SEP]
    expected = reference_score(sd, clip_preprocess(images, V["image_size"]), tokens["input_ids"], tokens["attention_mask"])
    print("imagereward", got.tolist(), "reference", expected.tolist())
    assert got.std() > 0.05  # the prompts and images move the score: not a constant
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # the padding is masked: a prompt's score does not depend on the others in the batch
    torch.testing.assert_close(reward(images[1:2], PROMPTS[1:2])["imagereward"], got[1:2], rtol=1e-5, atol=1e-5)


def test_conversion_and_loading_errors_are_named(vocab, tmp_path):
    sd = _checkpoint(tmp_path / "ImageReward.pt")
    parts = convert_state_dict(sd)
    assert "encoder.layers.1.self_attn.projection.weight" in parts["vision"] and "post_layernorm.bias" in parts["vision"]
    assert "layers.7.bias" in parts["head"] and not any("position_ids" in k for k in parts["text"])
    with pytest.raises(RewardError, match="'blip.visual_encoder.blocks.0.attn.rel_pos' is not part of BLIP's ViT"):
        convert_state_dict({**sd, "blip.visual_encoder.blocks.0.attn.rel_pos": torch.zeros(1)})
    with pytest.raises(RewardError, match="has no head weights"):
        convert_state_dict({k: v for k, v in sd.items() if not k.startswith("mlp.")})
    with pytest.raises(RewardError, match="does not fit the text model"):
        ImageReward(checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(vocab), vision_config=V, text_config={**T, "num_hidden_layers": 3})
    with pytest.raises(HubError, match="reward.options.imagereward.checkpoint=THUDM/ImageReward/ImageReward.pt: .*hf download THUDM/ImageReward ImageReward.pt"):
        build_reward("imagereward", tokenizer=str(vocab))
    random = ImageReward(random_init=True, tokenizer=str(vocab), vision_config=V, text_config=T)
    out = random(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), PROMPTS[:2])["imagereward"]
    assert out.shape == (2,) and torch.isfinite(out).all()
