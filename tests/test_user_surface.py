"""What a user does with a run, for every registered algorithm and every model family (parametrised from the registries,
so a new algorithm group or family folder is covered without editing this file):

    diffrl train experiment=<recipe> …            (2 RL steps at tiny sizes, a checkpoint at the end)
    diffrl eval --run RUN                          = the run's own last evaluation, number for number
    diffrl sample --run RUN --prompts … --seeds …  the trained policy's images (not the base model's)
    diffrl export-lora --run RUN                   = the checkpoint's adapter with alpha/r folded into lora_B
    diffrl train … trainer.resume=auto             one more step from the checkpoint
    diffrl.tools.analysis.load_policy(RUN)         = the checkpoint's weights

Each algorithm runs its digits recipe (the recipe whose defaults select its group; the default recipe with
``algorithm=<group>`` when none does); each family its tiny recipe (or the digits recipe that uses it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file

from diffrl.checkpoint import list_checkpoints
from diffrl.config import ModelConfig
from diffrl.logging import read_jsonl
from diffrl.algorithms import algorithm_class
from diffrl.recipes import CONFIG_DIR, compose
from diffrl.tools.analysis import load_policy
from diffrl.tools.cli import main
from pipelines.base import family_class, known_families

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.exact]  # each number is compared on one code path

EXPERIMENTS = CONFIG_DIR / "experiment"
ALGORITHM_GROUPS = sorted(p.stem for p in (CONFIG_DIR / "algorithm").glob("*.yaml"))
TINY = [
    "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.checkpoint_every=2", "trainer.wandb=disabled",
    "trainer.progress=false", "eval.every=0", "eval.num_prompts=2", "eval.seeds_per_prompt=1", "sampler.num_steps=3", "sampler.eval_num_steps=3",
    "algorithm.mini_batch_size=null",
]


def _defaults(recipe: Path, group: str) -> str | None:
    match = re.search(rf"^\s*-\s*override /{group}:\s*(\w+)", recipe.read_text(), re.M)
    return match.group(1) if match else None


def _family(model_group: str | None) -> str | None:
    path = CONFIG_DIR / "model" / f"{model_group}.yaml"
    if not path.is_file():
        return None
    match = re.search(r"^family:\s*(\w+)", path.read_text(), re.M)
    return match.group(1) if match else ModelConfig().family


def _algorithm_cases() -> list[tuple[str, list[str]]]:
    """algorithm group → (recipe overrides): its first digits text-to-image recipe, else the default recipe with the group."""
    cases = []
    for group in ALGORITHM_GROUPS:
        recipes = sorted(p.stem for p in EXPERIMENTS.glob("digits_*.yaml") if _defaults(p, "algorithm") == group)
        plain = [r for r in recipes if _defaults(EXPERIMENTS / f"{r}.yaml", "model") in ("digits", "digits_eps")]
        chosen = (plain or recipes or [None])[0]
        cases.append((group, [f"experiment={chosen}"] if chosen else [f"algorithm={group}"]))
    return cases


def _family_cases() -> list[tuple[str, list[str]]]:
    """family → (recipe overrides): its tiny recipe, else a digits recipe on it."""
    by_family: dict[str, list[str]] = {}
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        family = _family(_defaults(path, "model"))
        if family and (path.stem.endswith("_tiny_flow_grpo") or path.stem.startswith("digits_")):
            by_family.setdefault(family, []).append(path.stem)
    walked = [overrides for _, overrides in _algorithm_cases()]
    cases = []
    for family in known_families():
        recipes = sorted(by_family.get(family, []), key=lambda r: (not r.endswith("_tiny_flow_grpo"), not r.endswith("flow_grpo"), r))
        overrides = [f"experiment={recipes[0]}"] if recipes else []
        if overrides not in walked:  # a family whose recipe an algorithm case already walks (digits, digits_eps) is covered
            cases.append((family, overrides))
    return cases


def _prompt_args(run: Path, family: str) -> list[str]:
    """What a user gives ``diffrl sample`` for the run's family: a prompt of its evaluations, or (an editing family) a
    records file with a source image and an instruction."""
    rows = [json.loads(line) for line in next((run / "images").glob("eval_step_*.jsonl")).read_text().splitlines()]
    if not getattr(family_class(family), "editing", False):
        return ["--prompts", rows[0]["prompt"]]
    source = run.parent / "source.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(source)
    records = run.parent / "records.jsonl"
    records.write_text(json.dumps({"source": str(source), "instruction": rows[0]["prompt"]}) + "\n")
    return ["--prompt-file", str(records)]


def _pixels(folder: Path) -> np.ndarray:
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in sorted((folder / "images").glob("*.png"))])


def _walk_the_user_surface(overrides: list[str], tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    cfg = compose(overrides)
    algorithm = algorithm_class(cfg.algorithm.trainer)  # its own tiny sizes, where its recipe ties them to its keys
    if cfg.sampler.get("window_range"):  # an SDE window inside the 3 steps (MixGRPO, Flow-GRPO-Fast)
        overrides = [*overrides, "sampler.window_size=2", "sampler.window_range=[0,3]"]
    assert main(["train", *overrides, *TINY, *algorithm.tiny_overrides, f"trainer.output_dir={run}"]) == 0
    (checkpoint,) = list_checkpoints(run / "checkpoints")
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    last = evals[-1]

    # eval --run: the trainer's last evaluation again, number for number
    assert main(["eval", "--run", str(run), "--out", str(tmp_path / "eval")]) == 0
    metrics = json.loads((tmp_path / "eval" / "eval.json").read_text())["metrics"]
    shared = [k for k in metrics if k in last and k.startswith("eval/")]
    assert shared and {k: metrics[k] for k in shared} == pytest.approx({k: last[k] for k in shared}, rel=1e-6, abs=1e-9)

    # sample --run: the trained policy (its images are not the base model's from the same seeds)
    family = OmegaConf.load(run / "config.yaml").model.family
    prompt = _prompt_args(run, family)
    for name, extra in (("trained", []), ("base", ["--base"])):
        assert main(["sample", "--run", str(run), *extra, *prompt, "--seeds", "7", "11", "--rewards", "none",
                     "--out", str(tmp_path / name)]) == 0
    trained, base = _pixels(tmp_path / "trained"), _pixels(tmp_path / "base")
    assert trained.shape == base.shape and trained.shape[0] == 2

    # load_policy: the checkpoint's trainable weights
    stored = load_file(str(checkpoint / "model.safetensors"))
    worker = load_policy(run)
    state = worker.engine.trainable_state()
    assert state and all(torch.equal(state[k], stored[k]) for k in state if k in stored)

    # export-lora --run: the checkpoint's default adapter, alpha/r folded into lora_B (LoRA runs of a family with a
    # diffusers LoRA format; without one, a one-line error naming the family)
    if any(".lora_B.default." in k for k in stored) and getattr(family_class(family), "lora_pipeline", None) is None:
        assert main(["export-lora", "--run", str(run), "--out", str(tmp_path / "lora")]) == 2
        assert f"no diffusers LoRA format is known for model family '{family}'" in capsys.readouterr().err
    elif any(".lora_B.default." in k for k in stored):
        out = tmp_path / "lora"
        assert main(["export-lora", "--run", str(run), "--out", str(out)]) == 0
        info = json.loads((out / "diffrl_lora.json").read_text())
        exported = load_file(str(out / "pytorch_lora_weights.safetensors"))
        lora_b = {k: v for k, v in stored.items() if ".lora_B.default." in k}
        assert len(exported) == 2 * len(lora_b)
        key, value = next(iter(lora_b.items()))
        suffix = key.replace(".default.weight", ".weight")
        (match,) = [v for k, v in exported.items() if k.endswith(suffix) and k.split(".", 1)[1] == suffix or k == suffix]
        torch.testing.assert_close(match, float(info["scale_folded_into_lora_B"]) * value.to(match.dtype), rtol=0, atol=0)

    # resume=auto: one more step from the checkpoint
    assert main(["train", *overrides, *TINY, *algorithm.tiny_overrides, "trainer.steps=3", "trainer.resume=auto", f"trainer.output_dir={run}"]) == 0
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("group, overrides", _algorithm_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_algorithm_through_every_command(group, overrides, tmp_path, capsys):
    _walk_the_user_surface(overrides, tmp_path, capsys)


@pytest.mark.parametrize("family, overrides", _family_cases(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_family_through_every_command(family, overrides, tmp_path, capsys):
    assert overrides, f"family {family} has no tiny recipe (configs/experiment/{family}_tiny_flow_grpo.yaml): add one"
    _walk_the_user_surface(overrides, tmp_path, capsys)
