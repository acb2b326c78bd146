"""Checkpoints by Hugging Face Hub id: a Hub cache built in a temporary ``HF_HOME`` (tiny models saved in the cache's own
layout: ``models--org--name/snapshots/<commit>/`` and ``refs/<branch>``), resolved offline (``HF_HUB_OFFLINE=1``), and the
one-line errors when a repository is not cached. No network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffrl.hub import HubError, cache_dir, parse_ref, resolve_file, resolve_folder, resolve_weights
from diffrl.recipes import ConfigError, compose, validate, validate_and_resolve
from diffrl.run_weights import hub_weights
from diffrl.tools.cli import main
from pipelines.base import build_adapter, resolve_model_path
from rewards.base import build_reward
from rewards.clip_models import PickScore, openai_clip_tokenizer

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY_HF_CLIP = {
    "text_config": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 2, "num_hidden_layers": 1},
    "vision_config": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 2, "num_hidden_layers": 1, "patch_size": 32, "image_size": 224},
    "projection_dim": 16,
}


def cached_repo(home: Path, repo_id: str, commit: str = COMMIT, branch: str = "main") -> Path:
    """The snapshot folder of ``repo_id`` at ``commit`` in the hub cache under ``home``, with ``refs/<branch>`` → commit."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


@pytest.fixture
def hub_home(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture
def tiny_pickscore_on_hub(hub_home):
    """PickScore's published repositories (model and processor), as tiny random models in the cache."""
    reward = PickScore(random_init=True, model_config=TINY_HF_CLIP, seed=7)
    reward.model.save_pretrained(cached_repo(hub_home, "yuvalkirstain/PickScore_v1"))
    processor = cached_repo(hub_home, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    openai_clip_tokenizer().save_pretrained(processor)
    from transformers import CLIPImageProcessor

    CLIPImageProcessor().save_pretrained(processor)
    return reward


def test_references_parse_as_local_paths_or_hub_ids(tmp_path):
    assert parse_ref("stabilityai/stable-diffusion-3.5-medium").repo_id == "stabilityai/stable-diffusion-3.5-medium"
    ref = parse_ref("xswu/HPSv2/HPS_v2.1_compressed.pt@v1")
    assert (ref.repo_id, ref.filename, ref.revision) == ("xswu/HPSv2", "HPS_v2.1_compressed.pt", "v1")
    assert parse_ref("org/name", revision="abc").revision == "abc" and parse_ref("org/name@def", revision="abc").revision == "def"
    (tmp_path / "org" / "name").mkdir(parents=True)
    for local in (str(tmp_path / "org" / "name"), "./org/name", "~/weights", "/abs/path", "model.pt", "a/../b"):
        assert parse_ref(local) is None, local
    assert str(ref) == "xswu/HPSv2/HPS_v2.1_compressed.pt@v1"


def test_model_path_by_hub_id_loads_the_cached_snapshot(hub_home):
    tiny = build_adapter("sd3")  # the tiny random configuration (seed 0)
    snapshot = cached_repo(hub_home, "tinyorg/sd3-tiny")
    tiny.save_pretrained(snapshot)
    (snapshot / "sd3_single_file.safetensors").write_bytes(b"never read")  # a repo's extra files are not needed
    assert cache_dir() == hub_home / "hub"
    assert Path(resolve_model_path("sd3", "tinyorg/sd3-tiny")) == snapshot
    loaded = build_adapter("sd3", path="tinyorg/sd3-tiny", revision="main")
    for (name, a), (_, b) in zip(tiny.denoiser.state_dict().items(), loaded.denoiser.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # a revision: a second commit under a tag; the commit hash itself also resolves
    other = cached_repo(hub_home, "tinyorg/sd3-tiny", commit="f" * 40, branch="v2")
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert resolve_folder("tinyorg/sd3-tiny@v2") == other
    assert resolve_folder("tinyorg/sd3-tiny", revision=COMMIT) == snapshot


def test_hub_errors_are_one_line_naming_repo_revision_and_fetch_command(hub_home):
    with pytest.raises(HubError) as info:
        resolve_model_path("sd3", "stabilityai/stable-diffusion-3.5-medium", revision="v1.0")
    text = str(info.value)
    assert "\n" not in text and "model.path=stabilityai/stable-diffusion-3.5-medium@v1.0" in text and "revision v1.0" in text
    assert "HF_HUB_OFFLINE=1" in text and "hf download stabilityai/stable-diffusion-3.5-medium --revision v1.0 --include 'transformer/*'" in text
    with pytest.raises(HubError, match=r"hf download xswu/HPSv2 HPS_v2.1_compressed.pt"):
        resolve_file("xswu/HPSv2/HPS_v2.1_compressed.pt", key="+reward.options.hpsv2.checkpoint")
    with pytest.raises(HubError, match="names a repository"):
        resolve_file("xswu/HPSv2")
    with pytest.raises(HubError, match="names a file"):
        resolve_folder("xswu/HPSv2/x.pt")


def test_reward_by_default_repo_and_by_file_ref(hub_home, tiny_pickscore_on_hub, tmp_path):
    images = torch.randint(0, 256, (3, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    prompts = ["a red cat", "a lighthouse at dusk", "two dogs"]
    expected = tiny_pickscore_on_hub(images, prompts)["pickscore"]
    by_default = build_reward("pickscore")  # no options: the published repositories, from the cache
    assert torch.allclose(by_default(images, prompts)["pickscore"], expected, atol=1e-5)
    assert torch.allclose(build_reward("pickscore", checkpoint="yuvalkirstain/PickScore_v1")(images, prompts)["pickscore"], expected, atol=1e-5)
    # one file of a repository: an open_clip-style state dict read by the aesthetic reward's head
    head = cached_repo(hub_home, "someorg/aesthetic-head") / "head.pth"
    torch.save({"layers.0.weight": torch.ones(2, 2)}, head)
    assert resolve_weights("someorg/aesthetic-head/head.pth", "file") == head
    # a processor-only folder needs no weights; a model folder without safetensors would fetch *.bin (not cached: error names it)
    assert resolve_weights("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "processor").is_dir()


def test_validate_checks_the_cache_before_anything_is_built(hub_home, tiny_pickscore_on_hub):
    ok, parts = validate_and_resolve(compose(["experiment=sd3_tiny_flow_grpo", "reward.names=[pickscore]", "reward.weights=[1.0]"]))
    assert [(key, ref) for key, ref, _ in hub_weights(ok.model, ok.reward, parts)] == [("+reward.options.pickscore.checkpoint", "yuvalkirstain/PickScore_v1"),
                                                              ("+reward.options.pickscore.processor", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")]
    with pytest.raises(ConfigError, match=r"model.path=stabilityai/stable-diffusion-3.5-medium: .*revision main.*hf download"):
        validate(compose(["experiment=sd3_tiny_flow_grpo", "model.path=stabilityai/stable-diffusion-3.5-medium"]))
    with pytest.raises(ConfigError, match=r"reward.options.hpsv2.checkpoint=xswu/HPSv2/HPS_v2.1_compressed.pt"):
        validate(compose(["experiment=sd3_tiny_flow_grpo", "reward.names=[hpsv2]", "reward.weights=[1.0]"]))
    # random weights need nothing from the Hub
    random_init, parts = validate_and_resolve(compose(["experiment=sd3_tiny_flow_grpo", "reward.names=[hpsv2]", "reward.weights=[1.0]",
                                                       "+reward.options.hpsv2.random_init=true"]))
    assert hub_weights(random_init.model, random_init.reward, parts) == []


def test_train_with_model_and_reward_by_hub_id_offline(hub_home, tiny_pickscore_on_hub, tmp_path, capsys, single_thread):
    build_adapter("sd3").save_pretrained(cached_repo(hub_home, "tinyorg/sd3-tiny"))
    out = tmp_path / "run"
    short = ["sampler.num_steps=2", "sampler.eval_num_steps=2", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=2",
             "eval.seeds_per_prompt=1", "eval.every=0", "trainer.checkpoint_every=0", "trainer.progress=false",
             "trainer.wandb=disabled", "reward.names=[pickscore]", "reward.weights=[1.0]"]
    assert main(["train", "experiment=sd3_tiny_flow_grpo", "model.path=tinyorg/sd3-tiny", f"trainer.output_dir={out}", *short]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [line["reward/pickscore_mean"] for line in lines if "reward/pickscore_mean" in line]
    evals = [line["eval/pickscore"] for line in lines if "eval/pickscore" in line]
    assert len(rewards) == 2 and len(evals) == 2 and all(0 < abs(r) <= 100 for r in rewards + evals)
    capsys.readouterr()
    # not cached: the one-line error before anything is built (no run folder)
    missing = tmp_path / "missing"
    assert main(["train", "experiment=sd3_tiny_flow_grpo", "model.path=tinyorg/not-cached", f"trainer.output_dir={missing}", *short]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("diffrl: error: model.path=tinyorg/not-cached") and "hf download tinyorg/not-cached" in err
    assert not missing.exists()
