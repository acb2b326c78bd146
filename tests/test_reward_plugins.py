"""The reward plug-in API: rewards written outside the package (module:Class, entry point), declared
batch_size / input kind / scale honoured by ``score``, and checked by numbers."""

from __future__ import annotations

import textwrap

import pytest
import torch

from rewards.base import Reward, RewardError, build_reward, call_reward, registered_names, score, to_pil

PLUGIN_SOURCE = textwrap.dedent('''
    import torch

    class Brightness:
        """Mean pixel value of one channel in [0, 1] (not a subclass of Reward: duck typing is enough)."""

        unit = "fraction of full scale"
        scale = (0.0, 1.0)

        def __init__(self, channel=None):
            self.channel = channel

        def __call__(self, images, prompts, metadata=None):
            x = images.float() / 255.0
            if self.channel is not None:
                x = x[:, self.channel : self.channel + 1]
            return {self.name: x.mean(dim=(1, 2, 3))}

    def prompt_length(images, prompts, metadata=None):
        return {"prompt_length": torch.tensor([float(len(p)) for p in prompts])}
''')


def _images(batch: int, height: int = 8, width: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 3, height, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_module_class_plugin_outside_package_weighted_with_builtin(tmp_path, monkeypatch):
    (tmp_path / "my_reward_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    images, prompts = _images(6), ["a red one", "a blue two", "x", "yy", "zzz", "a green nine"]
    brightness = build_reward("my_reward_plugin:Brightness", channel=1)
    assert brightness.name == "my_reward_plugin:Brightness"
    jpeg = build_reward("jpeg_compressibility")
    out = score({"my_reward_plugin:Brightness": (brightness, 0.5), "jpeg_compressibility": (jpeg, 2.0)}, images, prompts)
    expected_brightness = images[:, 1].double().mean(dim=(1, 2)) / 255.0
    torch.testing.assert_close(out["reward/my_reward_plugin:Brightness"].double(), expected_brightness, rtol=0, atol=1e-6)
    expected_total = 0.5 * out["reward/my_reward_plugin:Brightness"] + 2.0 * jpeg(images, prompts)["jpeg_compressibility"]
    torch.testing.assert_close(out["rewards"], expected_total, rtol=0, atol=1e-6)
    # a plain function works too (it takes no options)
    length = build_reward("my_reward_plugin:prompt_length")
    assert score({"len": (length, 1.0)}, images, prompts)["rewards"].tolist() == [9.0, 10.0, 1.0, 2.0, 3.0, 12.0]
    # the main output is filed under the configured name even when the reward's own key differs
    assert score({"len": (length, 1.0)}, images, prompts)["reward/len"].tolist() == [9.0, 10.0, 1.0, 2.0, 3.0, 12.0]
    with pytest.raises(RewardError, match="is a function and takes no options"):
        build_reward("my_reward_plugin:prompt_length", scale=2)
    with pytest.raises(RewardError, match=r"cannot build Brightness.*check reward.options"):
        build_reward("my_reward_plugin:Brightness", chanel=1)
    with pytest.raises(RewardError, match="has no attribute 'Nope'"):
        build_reward("my_reward_plugin:Nope")
    with pytest.raises(RewardError, match="cannot import module 'no_such_plugin_mod'.*PYTHONPATH"):
        build_reward("no_such_plugin_mod:Reward")


def test_entry_point_plugin(tmp_path, monkeypatch):
    """A distribution on sys.path (a *.dist-info with entry_points.txt) registers ``red_fraction``."""
    (tmp_path / "diffrl_test_ep_plugin.py").write_text(textwrap.dedent('''
        import torch
        from rewards.base import Reward

        class RedFraction(Reward):
            unit = "fraction of pixels"
            scale = (0.0, 1.0)
            batch_size = 2

            def __init__(self, threshold=128):
                self.threshold = threshold

            def __call__(self, images, prompts, metadata=None):
                assert images.shape[0] <= 2
                red = (images[:, 0] >= self.threshold) & (images[:, 1] < self.threshold) & (images[:, 2] < self.threshold)
                return {self.name: red.float().mean(dim=(1, 2))}
    '''))
    dist = tmp_path / "diffrl_test_ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: diffrl-test-ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[diffrl.rewards]\nred_fraction = diffrl_test_ep_plugin:RedFraction\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "red_fraction" in registered_names()
    reward = build_reward("red_fraction", threshold=100)
    assert reward.name == "red_fraction"
    images = torch.zeros(5, 3, 4, 4, dtype=torch.uint8)
    for b in range(5):  # sample b has b red pixels (of 16)
        images[b, 0].view(-1)[:b] = 200
    images[4, 1, 0, 0] = 200  # one of sample 4's red pixels turns yellow
    out = score({"red_fraction": (reward, 1.0)}, images, ["p"] * 5)
    assert out["reward/red_fraction"].tolist() == [0.0, 1 / 16, 2 / 16, 3 / 16, 3 / 16]


class ChunkRecorder(Reward):
    """Records the size of each call; returns each sample's mean pixel and its per-sample metadata id."""

    batch_size = 3
    scale = (0.0, 255.0)

    def __init__(self, nan_at: int | None = None):
        self.calls: list[int] = []
        self.nan_at = nan_at

    def __call__(self, images, prompts, metadata=None):
        assert isinstance(images, torch.Tensor) and images.dtype == torch.uint8
        self.calls.append(images.shape[0])
        value = images.float().mean(dim=(1, 2, 3))
        if self.nan_at is not None and self.nan_at < images.shape[0] and len(self.calls) == 2:
            value[self.nan_at] = float("nan")
        return {"chunked": value, "sample_id": torch.tensor([float(m) for m in metadata])}


def test_batch_size_chunks_and_sample_indices():
    images = _images(8, seed=1)
    recorder = ChunkRecorder()
    recorder.name = "chunked"
    out = score({"chunked": (recorder, 1.0)}, images, [str(i) for i in range(8)], metadata=list(range(8)))
    assert recorder.calls == [3, 3, 2]
    torch.testing.assert_close(out["reward/chunked"], images.float().mean(dim=(1, 2, 3)), rtol=0, atol=1e-5)
    assert out["reward/sample_id"].tolist() == list(range(8))  # per-sample metadata sliced with the chunks, in order
    # unchunked reference: the same numbers as one call on the whole batch
    recorder.batch_size = None
    assert torch.equal(call_reward("chunked", recorder, images, ["p"] * 8, list(range(8)))["chunked"], out["reward/chunked"])
    assert recorder.calls[-1] == 8
    # NaN at position 1 of the second chunk is sample 3 + 1 = 4 of the batch
    bad = ChunkRecorder(nan_at=1)
    with pytest.raises(RewardError, match=r"reward 'chunked' returned nan for sample 4 "):
        score({"chunked": (bad, 1.0)}, images, ["p"] * 8, metadata=list(range(8)))


class RedMeanFromPil(Reward):
    """Mean of the red channel computed on PIL images (numpy), one image at a time."""

    input = "pil"
    batch_size = 2

    def __call__(self, images, prompts, metadata=None):
        import numpy as np
        from PIL import Image

        assert isinstance(images, list) and all(isinstance(im, Image.Image) and im.mode == "RGB" for im in images)
        return {self.name: torch.tensor([float(np.asarray(im)[:, :, 0].mean()) for im in images])}


def test_pil_input_conversion_is_exact():
    images = _images(5, height=6, width=10, seed=2)  # H != W catches a transposed conversion
    reward = RedMeanFromPil()
    reward.name = "red_mean"
    out = score({"red_mean": (reward, 1.0)}, images, ["p"] * 5)
    torch.testing.assert_close(out["reward/red_mean"], images[:, 0].float().mean(dim=(1, 2)), rtol=0, atol=1e-4)
    pil = to_pil(images)
    assert pil[3].size == (10, 6)
    for b, y, x in [(0, 0, 0), (3, 5, 9), (4, 2, 7)]:
        assert pil[b].getpixel((x, y)) == tuple(images[b, :, y, x].tolist())


def test_declared_scale_and_declarations_are_checked():
    class TooBright(Reward):
        scale = (0.0, 1.0)

        def __call__(self, images, prompts, metadata=None):
            return {self.name: torch.tensor([0.0, 1.0, 1.5])[: images.shape[0]]}

    reward = TooBright()
    reward.name = "too_bright"
    with pytest.raises(RewardError, match=r"reward 'too_bright' returned 1.5 for sample 2, outside its declared scale \[0.0, 1.0\]"):
        score({"too_bright": (reward, 1.0)}, _images(3), ["p"] * 3)
    reward.input = "jpeg"
    with pytest.raises(RewardError, match=r"declares input='jpeg'; use one of \('uint8', 'pil'\)"):
        score({"too_bright": (reward, 1.0)}, _images(3), ["p"] * 3)
    reward.input, reward.batch_size = "uint8", 0
    with pytest.raises(RewardError, match="declares batch_size=0"):
        score({"too_bright": (reward, 1.0)}, _images(3), ["p"] * 3)
    with pytest.raises(ValueError, match=r"uint8 images \[B, 3, H, W\], got torch.float32.*\* 255"):
        score({"jpeg": (build_reward("jpeg_compressibility"), 1.0)}, _images(2).float() / 255, ["p"] * 2)
    with pytest.raises(ValueError, match="got 1 prompts for 2 images"):
        score({"jpeg": (build_reward("jpeg_compressibility"), 1.0)}, _images(2), ["p"])
