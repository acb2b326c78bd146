"""``hpsv3`` on transformers' Qwen2-VL: Qwen-VL's resize rule and the checkpoint key translation by closed forms;
the trained prompt format (one <|Reward|> per row, read at its position) and batch invariance on a tiny random
Qwen2-VL with a tokenizer and processor built offline."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from diffrl.hub import HubError
from rewards.base import RewardError, build_reward
from rewards.hpsv3 import INSTRUCTION, REWARD_TOKEN, SUFFIX, HPSv3, convert_keys, smart_resize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PIXELS = 4 * 28 * 28


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A Qwen2-VL processor folder: a byte-level BPE trained here on HPSv3's prompt, the image processor, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([INSTRUCTION, SUFFIX, "user assistant a red car a blue dog"], trainer)
    fast = Qwen2TokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=PIXELS, max_pixels=64 * 28 * 28), tokenizer=fast,
                                 video_processor=Qwen2VLVideoProcessor(), chat_template=TEMPLATE)
    folder = tmp_path_factory.mktemp("qwen2vl_base")
    processor.save_pretrained(folder)
    return folder, {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}, len(fast)


def _config(ids: dict, vocab: int) -> dict:
    return {
        "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                        "vocab_size": vocab, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def test_qwen_vl_resize_rule_and_key_translation_closed_forms():
    assert smart_resize(512, 512) == (448, 448)  # 504² > 256·28² → scaled by √(512²/200704) and floored to 28
    assert smart_resize(512, 768) == (364, 532)
    assert smart_resize(20, 30, min_pixels=PIXELS, max_pixels=PIXELS) == (56, 84)  # too small: ceiled up to the budget
    with pytest.raises(RewardError, match="aspect ratio 250 is over 200"):
        smart_resize(10, 2500)
    model, head = convert_keys({"visual.blocks.0.norm1.weight": 1, "model.layers.0.self_attn.q_proj.weight": 2, "model.embed_tokens.weight": 3,
                                "lm_head.weight": 4, "rm_head.0.weight": 5, "model.language_model.norm.weight": 6})
    assert model == {"model.visual.blocks.0.norm1.weight": 1, "model.language_model.layers.0.self_attn.q_proj.weight": 2,
                     "model.language_model.embed_tokens.weight": 3, "lm_head.weight": 4, "model.language_model.norm.weight": 6}
    assert head == {"0.weight": 5}
    with pytest.raises(RewardError, match="no rm_head"):
        convert_keys({"lm_head.weight": 4})


def test_tiny_hpsv3_reads_the_reward_token_and_is_batch_invariant(base, tmp_path):
    folder, ids, vocab = base
    reward = HPSv3(random_init=True, base=str(folder), model_config=_config(ids, vocab), pixels=PIXELS, dtype="float32")
    images = torch.randint(0, 256, (3, 3, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    prompts = ["a red car", "a blue dog", "a red dog on a blue car"]
    batch = reward.inputs(images, prompts)
    text = reward.processor.tokenizer.decode(batch["input_ids"][0])
    assert INSTRUCTION.format(text_prompt="a red car") + SUFFIX in text and re.sub(r"(<\|endoftext\|>)+$", "", text).endswith("<|im_start|>assistant\n")
    assert ((batch["input_ids"] == reward.reward_id).sum(1) == 1).all() and reward.reward_id == vocab  # added after the base vocabulary
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6]] * 3  # 40 × 48 → 56 × 84 px (smart_resize) → 4 × 6 patches of 14
    out = reward(images, prompts)
    assert out["hpsv3"].shape == (3,) and torch.isfinite(out["hpsv3"]).all() and out["hpsv3"].std() > 0
    for i in range(3):  # right padding + attention mask: each row scores as it would alone
        torch.testing.assert_close(reward(images[i : i + 1], prompts[i : i + 1])["hpsv3"], out["hpsv3"][i : i + 1], rtol=1e-4, atol=1e-5)
    # the score is the head at the reward token, recomputed by hand from the backbone's hidden states with HPSv3's
    # positions: 0…L−1 on all three M-RoPE axes (the package runs the backbone without position ids under
    # transformers 4.45); Qwen2-VL's own image positions give another number
    length = batch["input_ids"].shape[1]
    with torch.no_grad():
        at = (batch["input_ids"] == reward.reward_id).float().argmax(1)
        hidden = reward.model.model(**batch, position_ids=torch.arange(length).view(1, 1, -1).expand(3, 3, -1)).last_hidden_state
        by_hand = reward.head(hidden[torch.arange(3), at].float())
        mrope = reward.head(reward.model.model(**batch).last_hidden_state[torch.arange(3), at].float())
    torch.testing.assert_close(out["hpsv3"], by_hand[:, 0])
    assert (mrope[:, 0] - out["hpsv3"]).abs().max() > 1e-3 * out["hpsv3"].std()
    assert [k for k in reward.head.state_dict()][:2] == ["0.weight", "0.bias"]  # the package's rm_head.* names

    # a checkpoint in the released (transformers 4.45) names loads into the same numbers
    state = {("visual." + k[len("model.visual."):] if k.startswith("model.visual.") else "model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
             for k, v in reward.model.state_dict().items()}
    state.update({f"rm_head.{k}": v for k, v in reward.head.state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "HPSv3.safetensors"))
    loaded = build_reward("hpsv3", checkpoint=str(tmp_path / "HPSv3.safetensors"), base=str(folder), random_init=True, model_config=_config(ids, vocab),
                          pixels=PIXELS, dtype="float32", seed=123)
    torch.testing.assert_close(loaded(images, prompts)["hpsv3"], out["hpsv3"])
    with pytest.raises(RewardError, match=f"must hold {REWARD_TOKEN.replace('|', '.')} exactly once"):
        reward(images[:1], [f"a car {REWARD_TOKEN}"])
    with pytest.raises(HubError, match="reward.options.hpsv3.base=Qwen/Qwen2-VL-7B-Instruct: .*hf download Qwen/Qwen2-VL-7B-Instruct"):
        build_reward("hpsv3", checkpoint=str(tmp_path / "HPSv3.safetensors"))
