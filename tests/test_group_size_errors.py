"""Errors a user can cause are one line, ``diffrl: error: ...``, exit status 2, before any work: a group of one sample
for a group-relative algorithm, and more Ray ranks than the cluster holds."""

from __future__ import annotations

import json

import pytest

from diffrl.algorithms import build_algorithm
from diffrl.recipes import compose
from diffrl.tools.cli import main
from diffrl.run_setup import run_context

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

PROMPTS = ["a red seven", "a blue two"]

# every recipe whose update compares the samples of one prompt's group (and the override that selects it)
GROUP_RELATIVE = [
    ("digits_flow_grpo", ()),
    ("digits_flow_grpo", ("algorithm.adv_std_mode=none",)),  # Dr.GRPO: no std, but still centred on the group's mean
    ("digits_flow_grpo", ("algorithm.adv_std_mode=group",)),
    ("digits_flow_grpo_fast", ()),
    ("digits_mixgrpo", ()),
    ("digits_grpo_guard", ()),
    ("digits_dance_grpo", ()),
    ("digits_nft", ()),
    ("digits_awm", ()),
    ("digits_dpo", ()),  # online pairs: best and worst of each group
]


def _overrides(tmp_path, out, *extra, prompts_per_step: int = 2):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return [
        "trainer.steps=1", f"trainer.prompts_per_step={prompts_per_step}", "eval.seeds_per_prompt=1", "eval.every=100",
        "trainer.checkpoint_every=100", "trainer.threads=1", f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={prompts}",
        *extra,
    ]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffrl: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("experiment", "extra"), GROUP_RELATIVE, ids=[e + "".join(f"[{x}]" for x in extra) for e, extra in GROUP_RELATIVE])
def test_group_relative_algorithms_refuse_a_group_of_one(tmp_path, capsys, monkeypatch, experiment, extra):
    monkeypatch.delenv("DIFFRL_TRACEBACK", raising=False)
    out = tmp_path / "run"
    rc = main(["train", f"experiment={experiment}", "trainer.group_size=1", *_overrides(tmp_path, out, *extra)])
    assert rc == 2
    line = _one_line_error(capsys)
    assert "trainer.group_size=1 leaves algorithm=" in line and "set trainer.group_size=2 or more" in line, line
    assert not out.exists()  # refused before any work


def test_the_error_names_each_algorithms_own_way_out(tmp_path):
    def message(experiment):
        cfg = compose([f"experiment={experiment}", "trainer.group_size=1", *_overrides(tmp_path, tmp_path / "run")])
        with pytest.raises(ValueError) as info:
            build_algorithm(cfg.algorithm, run_context(cfg)).validate(1)
        return str(info.value)

    assert "algorithm=dance_grpo" in message("digits_dance_grpo") and "algorithm.adv_stat_tracker=true" in message("digits_dance_grpo")
    assert "algorithm.preference_pairs=" in message("digits_dpo")
    assert "algorithm=nft" in message("digits_nft") and "algorithm=awm" in message("digits_awm")


@pytest.mark.parametrize("extra", [(), ("trainer.group_size=2",)])
def test_groups_of_two_or_more_and_offline_pairs_pass(tmp_path, extra):
    for experiment, more in GROUP_RELATIVE:
        cfg = compose([f"experiment={experiment}", *_overrides(tmp_path, tmp_path / "run", *more, *extra)])
        build_algorithm(cfg.algorithm, run_context(cfg)).validate(1)
    # offline DPO pairs need no group: one sample per prompt (for the evaluations) is fine
    offline = ["experiment=digits_dpo", "trainer.group_size=1", "algorithm.preference_pairs=pairs.jsonl"]
    cfg = compose([*offline, *_overrides(tmp_path, tmp_path / "run")])
    build_algorithm(cfg.algorithm, run_context(cfg)).validate(1)


def test_ddpo_per_prompt_tracker_trains_with_a_group_of_one(tmp_path, capsys, monkeypatch):
    """DDPO's stat tracker normalises by the batch (then by each prompt's rewards across steps): a group of one is legitimate."""
    monkeypatch.delenv("DIFFRL_TRACEBACK", raising=False)
    out = tmp_path / "ddpo"
    overrides = _overrides(tmp_path, out, "sampler.num_steps=3", "sampler.eval_num_steps=2")
    rc = main(["train", "experiment=digits_ddpo", "trainer.group_size=1", *overrides])
    assert rc == 0, capsys.readouterr().err
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["advantage_abs_mean"] > 0


def test_more_ray_ranks_than_the_cluster_holds_is_one_line_exit_2(tmp_path, capsys, monkeypatch, ray_local):
    """``distributed.num_workers=64`` on a 2-CPU Ray: the capacity message, one line, status 2, no traceback, no run folder."""
    monkeypatch.delenv("DIFFRL_TRACEBACK", raising=False)
    out = tmp_path / "ray"
    capsys.readouterr()  # Ray's own start-up lines
    rc = main(["train", *_overrides(tmp_path, out, "distributed.backend=ray", "distributed.num_workers=64", "trainer.group_size=2",
                                    "algorithm.mini_batch_size=64", prompts_per_step=32)])
    assert rc == 2
    line = _one_line_error(capsys)
    assert "cannot hold distributed.num_workers=64 ranks" in line and "62 more rank(s)" in line and "lower distributed.num_workers" in line, line
    assert not out.exists()
