"""A new user's path (issue 56): every missing piece named at once, prompt files as users have them, errors that name
what the user typed, and the command line a Hydra user expects. Each test checks the real message or output."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffrl.algorithms import ALGORITHMS
from diffrl.config import DistributedConfig
from diffrl.data import load_prompts, read_prompts
from diffrl.logging import read_jsonl
from diffrl.distributed.checks import check_backend
from diffrl.recipes import CONFIG_DIR, ConfigError, check_sizes, compose, validate
from diffrl.tools.cli import main
from diffrl.tools.prompts import convert
from diffrl.trainer import groups_with_spread
from pipelines.base import EditPrompt
from rewards.base import Reward, missing_extra, register_reward

pytestmark = pytest.mark.exact  # messages, files and configs (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4", "eval.seeds_per_prompt=1", "eval.num_prompts=2",
         "trainer.progress=false", "algorithm.mini_batch_size=null", "sampler.num_steps=3", "sampler.eval_num_steps=2"]
GENEVAL_ROWS = [  # flow_grpo's dataset/geneval/train_metadata.jsonl rows, as its files hold them
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}], "prompt": "a photo of two clocks"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "pink"}], "prompt": "a photo of a pink car"},
    {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}],
     "prompt": "a photo of a dog left of a cat"},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- 2. every missing piece at once -------------------------------------------------------------------------
def test_every_missing_checkpoint_is_one_error_with_one_fetch_line_each_model_first(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "experiment=sd35m_pickscore_flow_grpo", "model.device=cpu", f"trainer.output_dir={out}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("diffrl: error: 3 checkpoints of this run are missing from the Hugging Face cache") and "HF_HUB_OFFLINE=1" in lines[0]
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["model.path", "+reward.options.pickscore.checkpoint", "+reward.options.pickscore.processor"]
    assert lines[1].startswith("  model.path: hf download stabilityai/stable-diffusion-3.5-medium --include")
    assert lines[2] == "  +reward.options.pickscore.checkpoint: hf download yuvalkirstain/PickScore_v1 --include '*.json' '*.txt' '*.model' '*.tiktoken' '*.safetensors'"
    assert lines[3].startswith("  +reward.options.pickscore.processor: hf download laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    assert not out.exists()  # before any folder is made

    assert main(["train", "experiment=sd35m_pickscore_flow_grpo", "model.device=cpu", "model.path=./nonexistent", f"trainer.output_dir={out}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == "  model.path=./nonexistent: no such file or folder; give a local diffusers folder or a Hub id (org/name)"
    assert len(lines) == 4 and not out.exists()


def test_a_local_model_path_that_does_not_exist_is_named_before_the_rewards_online(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online: the Hub pieces would download at build; the missing folder is refused now
    out = tmp_path / "run"
    assert main(["train", "experiment=sd35m_pickscore_flow_grpo", "model.device=cpu", "model.path=./nonexistent", f"trainer.output_dir={out}"]) == 2
    assert capsys.readouterr().err == "diffrl: error: model.path=./nonexistent: no such file or folder; give a local diffusers folder or a Hub id (org/name)\n"
    assert not out.exists()


# -- 3. prompt files as users have them ----------------------------------------------------------------------
def test_a_jsonl_of_geneval_rows_is_text_prompts_with_their_rows_as_metadata(tmp_path):
    file = _jsonl(tmp_path / "train_metadata.jsonl", GENEVAL_ROWS)
    assert read_prompts(file) == [r["prompt"] for r in GENEVAL_ROWS]
    prompts, table = load_prompts(str(file), "train")
    assert table == {r["prompt"]: {k: v for k, v in r.items() if k != "prompt"} for r in GENEVAL_ROWS}
    cfg = validate(compose(["experiment=sd35m_geneval_flow_grpo", "+shrink=tiny", f"trainer.prompts={file}"]))  # GenEval reads the rows
    assert cfg.trainer.prompts == str(file)
    wrapped = _jsonl(tmp_path / "wrapped.jsonl", [{"prompt": r["prompt"], "metadata": {k: v for k, v in r.items() if k != "prompt"}} for r in GENEVAL_ROWS])
    assert load_prompts(str(wrapped), "train") == (prompts, table)


def test_editing_records_are_recognised_by_their_fields_not_the_extension(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), (10, 200, 30)).save(tmp_path / "a.png")
    rows = [{"image": "a.png", "prompt": "make two apples", "tag": "counting", "include": [{"class": "apple", "count": 2}]}]  # flow_grpo's row
    for name in ("records.json", "records.txt", "records.jsonl"):
        records = read_prompts(_jsonl(tmp_path / name, rows))
        assert len(records) == 1 and isinstance(records[0], EditPrompt) and records[0].instruction == "make two apples"
        assert load_prompts(str(tmp_path / name), "train")[1] == {"make two apples": {"tag": "counting", "include": [{"class": "apple", "count": 2}]}}
    text = tmp_path / "lines.jsonl"  # a .jsonl of rows without a source image is text prompts
    _jsonl(text, [{"prompt": "a red seven"}])
    assert read_prompts(text) == ["a red seven"]
    with pytest.raises(ValueError, match=r"lines.jsonl: line 2 names a source image but earlier rows do not"):
        read_prompts(_jsonl(text, [{"prompt": "a red seven"}, {"source": "a.png", "instruction": "x"}]))


def test_a_prompt_the_reward_cannot_read_is_refused_before_any_folder(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a cat\nmake it blue\n")
    out = tmp_path / "run"
    assert main(["train", "experiment=sd35m_geneval_flow_grpo", "+shrink=tiny", f"trainer.prompts={prompts}", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"diffrl: error: trainer.prompts={prompts}: reward 'geneval': cannot parse 'make it blue'") and err.count("\n") == 1
    assert "diffrl prompts convert" in err and not out.exists()


def test_converters_for_flow_grpos_geneval_ocr_and_counting_edit_sets(tmp_path, capsys):
    from PIL import Image

    geneval = tmp_path / "geneval"
    geneval.mkdir()
    _jsonl(geneval / "test_metadata.jsonl", GENEVAL_ROWS)
    assert main(["prompts", "convert", "--format", "geneval", "--split", "test", str(geneval), str(tmp_path / "g.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert rows[0] == {"prompt": "a photo of two clocks", "metadata": {"tag": "counting", "include": [{"class": "clock", "count": 2}],
                                                                     "exclude": [{"class": "clock", "count": 3}]}}
    assert json.loads(capsys.readouterr().out) == {"out": str(tmp_path / "g.jsonl"), "format": "geneval", "records": 3, "use": f"trainer.prompts={tmp_path / 'g.jsonl'}"}

    ocr = tmp_path / "ocr.txt"
    ocr.write_text('A bakery sign that reads "FRESH BREAD"\nA mug printed with “Good Morning”\n')
    assert convert("ocr", ocr, tmp_path / "o.jsonl") == 2
    assert [json.loads(line)["metadata"]["text"] for line in (tmp_path / "o.jsonl").read_text().splitlines()] == ["FRESH BREAD", "Good Morning"]
    ocr.write_text('A sign that reads "OPEN"\nA quiet street at night\n')
    with pytest.raises(ValueError, match=r"ocr.txt: line 2 quotes no text to render"):
        convert("ocr", ocr, tmp_path / "o2.jsonl")
    assert not (tmp_path / "o2.jsonl").exists()

    counting = tmp_path / "counting_edit"
    (counting / "images").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(counting / "images" / "0.png")
    row = {"prompt": "change the number of cups to three", "image": "images/0.png", "tag": "counting",
           "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]}
    _jsonl(counting / "train_metadata.jsonl", [row])
    out = tmp_path / "records" / "counting.jsonl"
    assert main(["prompts", "convert", "--format", "counting-edit", str(counting), str(out)]) == 0
    record = json.loads(out.read_text())
    assert record == {"source": "../counting_edit/images/0.png", "instruction": row["prompt"],
                      "metadata": {"tag": "counting", "include": row["include"], "exclude": row["exclude"]}}
    edits = read_prompts(out)
    assert edits[0].instruction == row["prompt"] and tuple(edits[0].source.shape) == (3, 8, 8)
    assert main(["prompts", "convert", "--format", "counting-edit", str(counting), str(out)]) == 2
    assert "exists; choose another OUT or add --overwrite" in capsys.readouterr().err
    _jsonl(counting / "train_metadata.jsonl", [{**row, "image": "images/9.png"}])
    assert main(["prompts", "convert", "--format", "counting-edit", "--overwrite", str(counting), str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 1 names source image" in err and "generated_images.zip" in err and err.count("\n") == 1


def test_a_recipe_that_needs_records_says_so_before_any_folder_and_shrink_brings_tiny_ones(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "experiment=flux_kontext_counting_flow_grpo", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffrl: error: experiment=flux_kontext_counting_flow_grpo needs trainer.prompts=<editing records of counting edits")
    assert "diffrl prompts convert" in err and "+shrink=tiny" in err and err.count("\n") == 1 and not out.exists()
    cfg = validate(compose(["experiment=flux_kontext_counting_flow_grpo", "+shrink=tiny"]))
    assert cfg.trainer.prompts == str(ROOT / "assets" / "tiny_records" / "counting_edit")
    records, table = load_prompts(cfg.trainer.prompts, "train")
    assert len(records) == 4 and all(table[r.instruction]["tag"] == "counting" for r in records)
    mine = tmp_path / "mine.jsonl"  # the user's records win over the stand-ins
    _jsonl(mine, [{"source": str(ROOT / "assets/tiny_records/counting_edit/source_0.png"), "instruction": "x",
                   "metadata": {"tag": "counting", "include": [{"class": "cup", "count": 1}]}}])
    assert compose(["experiment=flux_kontext_counting_flow_grpo", "+shrink=tiny", f"trainer.prompts={mine}"]).trainer.prompts == str(mine)


@register_reward("test_metadata_probe")
class MetadataProbe(Reward):
    """The ``k`` of each sample's metadata row (-1 when the sample has none): shows what reached the reward."""

    def __call__(self, images, prompts, metadata=None):
        rows = metadata if isinstance(metadata, list) else [{}] * len(prompts)
        return {self.name: torch.tensor([float(r.get("k", -1)) for r in rows])}


def test_sample_with_a_records_file_keeps_each_prompts_metadata(tmp_path, capsys, single_thread):
    records = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a red seven", "metadata": {"k": 7}}, {"prompt": "a blue two", "metadata": {"k": 2}}])
    out = tmp_path / "samples"
    assert main(["sample", "--prompt-file", str(records), "--seeds", "0", "--rewards", "test_metadata_probe", "--out", str(out),
                 "sampler.eval_num_steps=2"]) == 0
    samples = json.loads((out / "samples.json").read_text())["samples"]
    assert [s["rewards"]["test_metadata_probe"] for s in samples] == [7.0, 2.0]
    assert [s["metadata"] for s in samples] == [{"k": 7}, {"k": 2}]


def test_sample_on_an_editing_run_keeps_the_records_metadata(tmp_path, single_thread):
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 20, 20)).save(tmp_path / "a.png")
    records = _jsonl(tmp_path / "edits.jsonl", [{"source": "a.png", "instruction": "make it blue", "metadata": {"k": 3}}])
    out = tmp_path / "samples"
    assert main(["sample", "experiment=digits_edit_flow_grpo", "sampler.eval_num_steps=2", "--prompt-file", str(records), "--seeds", "0", "1",
                 "--rewards", "test_metadata_probe", "--out", str(out)]) == 0
    samples = json.loads((out / "samples.json").read_text())["samples"]
    assert [(s["rewards"]["test_metadata_probe"], s["metadata"], s["source"]) for s in samples] == [(3.0, {"k": 3}, "a.png")] * 2


# -- 4. errors that name what the user typed -----------------------------------------------------------------
def test_a_misspelt_reward_gets_the_closest_names_not_the_registry():
    with pytest.raises(ConfigError) as info:
        validate(compose(["reward.names=[pickscor]"]))
    message = str(info.value)
    assert message.startswith("reward.names=[pickscor]: unknown reward 'pickscor': did you mean 'pickscore'?") and len(message) < 250, message
    with pytest.raises(ConfigError) as info:
        validate(compose(["reward.gold=qqqqzzzz"]))
    assert str(info.value).startswith("reward.gold=qqqqzzzz: unknown reward 'qqqqzzzz': none of the") and "docs/rewards.md" in str(info.value)


def test_an_empty_group_option_shows_no_hydra_internals():
    with pytest.raises(ConfigError) as info:
        compose(["algorithm="])
    message = str(info.value)
    assert message.startswith("algorithm=: no such algorithm config; choose one of: awm, dance_grpo"), message
    assert "schema_" not in message and "search path" not in message


def test_a_reward_name_given_as_the_reward_group_names_reward_names():
    with pytest.raises(ConfigError) as info:
        compose(["reward=pickscore"])
    assert str(info.value).endswith("to train on the reward 'pickscore', set reward.names=[pickscore] (reward=<group> picks a group of settings)")


def test_an_optional_group_without_its_plus_says_how_to_add_it():
    with pytest.raises(ConfigError) as info:
        compose(["experiment=sd35m_geneval_flow_grpo", "shrink=tiny"])
    assert str(info.value) == "shrink=tiny: shrink is an optional config group, added with a +: +shrink=tiny (options: tiny)"


def test_a_derived_values_error_names_the_key_the_user_set():
    with pytest.raises(ConfigError) as info:  # mini_batch_size = ${optimizer_steps:2} derives from the group size
        compose(["experiment=sd35m_pickscore_flow_grpo", "trainer.group_size=0"])
    assert str(info.value) == "trainer.group_size=0 is invalid: it must be ≥ 1 (algorithm.mini_batch_size=${optimizer_steps:2} is derived from it)"
    with pytest.raises(ConfigError, match=r"^trainer\.group_size=0 is invalid"):
        validate(compose(["trainer.group_size=0", "algorithm.mini_batch_size=0"]))  # a size given directly: the trainer key comes first


def test_the_backend_is_checked_before_the_sizes():
    cfg = validate(compose(["distributed.num_workers=2", "trainer.prompts_per_step=3", "trainer.group_size=3",  # 9 rows split over 2 fails too
                            "algorithm.mini_batch_size=null"]))  # (the default recipe's two optimizer steps would refuse 9 rows first)
    with pytest.raises(ValueError) as info:
        check_sizes(cfg)
    assert str(info.value) == ("distributed.backend=local runs one worker in this process; for distributed.num_workers=2 set distributed.backend=ray "
                               "(pip install -e '.[ray]'), or distributed.num_workers=1")


def test_missing_extras_are_one_line_naming_the_pip_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a, **k: None if name == "ray" else real(name, *a, **k))
    with pytest.raises(ValueError, match=r"^distributed\.backend=ray needs Ray, which is not installed: pip install -e '\.\[ray\]'$"):
        check_backend(DistributedConfig(backend="ray", num_workers=2))
    assert missing_extra("ocr", find_spec=lambda name: None) == ("reward 'ocr' needs the package 'rapidocr_onnxruntime', which is not installed: "
                                                                 "pip install -e '.[rewards]'")
    assert missing_extra("pickscore") is None and missing_extra("digits", find_spec=lambda name: None) is None
    monkeypatch.setattr("rewards.base.EXTRAS", {"digits": ("diffrl_no_such_module", "rewards")})
    with pytest.raises(ConfigError, match=r"^reward\.names=\[digits\]: reward 'digits' needs the package 'diffrl_no_such_module', which is not installed"):
        validate(compose([]))


def test_algorithm_name_follows_the_group_and_another_value_is_refused():
    assert compose([]).algorithm.name == "flow_grpo" and compose(["algorithm=nft"]).algorithm.name == "nft"
    assert compose(["algorithm=dance_grpo"]).algorithm.name == "dance_grpo" and compose(["algorithm.name=flow_grpo"]).algorithm.name == "flow_grpo"
    with pytest.raises(ConfigError) as info:
        compose(["algorithm.name=nft"])
    assert str(info.value).startswith("algorithm.name=nft does not match the algorithm group algorithm=flow_grpo") and "select it with algorithm=nft" in str(info.value)
    with pytest.raises(ConfigError, match=r"algorithm\.name=my_label does not match .* it is not a setting"):
        compose(["algorithm.name=my_label"])


def test_algorithm_trainers_doc_names_every_class_and_group():
    tree = ast.parse((ROOT / "diffrl" / "config.py").read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AlgorithmConfig").body
    index = next(i for i, n in enumerate(body) if isinstance(n, ast.AnnAssign) and n.target.id == "trainer")
    doc = body[index + 1].value.value
    assert "diffrl.algorithms.ALGORITHMS" in doc and "docs/algorithms.md" in doc, doc  # the registry, not a list that goes stale
    listed = (ROOT / "docs" / "algorithms.md").read_text()
    groups = sorted(p.stem for p in (CONFIG_DIR / "algorithm").glob("*.yaml"))
    assert len(ALGORITHMS) >= 8 and len(groups) >= 13
    assert all(re.search(rf"\b{name}\b", listed) for name in [*ALGORITHMS, *groups]), [n for n in [*ALGORITHMS, *groups] if n not in listed]


# -- 5. the command line a Hydra user expects ------------------------------------------------------------------
def test_cfg_job_prints_the_composed_config_and_builds_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "experiment=digits_nft", "trainer.steps=7", "--cfg", "job", f"trainer.output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "experiment: digits_nft" in text and "  steps: 7" in text and "  name: nft" in text and "trainer: nft" in text
    assert not out.exists()


def test_a_misspelt_command_gets_the_closest(capsys):
    assert main(["trian", "trainer.steps=2"]) == 2
    assert capsys.readouterr().err == ("diffrl: error: no command 'trian' (did you mean 'train'?); commands: train, sample, eval, export-lora, "
                                       "serve-reward, plan, prompts (diffrl --help)\n")


def test_train_help_lists_the_recipes_and_shrink(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert all(p.stem in text for p in (CONFIG_DIR / "experiment").glob("*.yaml")) and "+shrink=tiny" in text and "--cfg" in text


def test_diffrl_help_imports_no_torch_and_answers_under_two_seconds():
    code = "import sys; from diffrl.tools.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, 'hydra' in sys.modules)"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert proc.stdout.splitlines()[-1] == "False False" and "prompts" in proc.stdout
    assert elapsed < 2.0, elapsed


def test_groups_with_spread_counts_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 2.0, 2.0])
    assert groups_with_spread(rewards, torch.tensor([0, 0, 1, 1, 2, 2])) == pytest.approx(1 / 3)
    assert groups_with_spread(torch.zeros(4), torch.tensor([0, 0, 1, 1])) == 0.0


@register_reward("test_constant")
class Constant(Reward):
    """The same score for every image: no group ever has reward spread."""

    def __call__(self, images, prompts, metadata=None):
        return {self.name: torch.full((images.shape[0],), 0.5)}


def test_a_run_without_reward_spread_warns_once(tmp_path, capsys, single_thread):
    out = tmp_path / "run"
    assert main(["train", f"trainer.output_dir={out}", "reward.names=[test_constant]", "trainer.no_spread_warning=2", "trainer.steps=3",
                 *[o for o in SHORT if not o.startswith("trainer.steps")]]) == 0
    text = capsys.readouterr().out
    assert text.count("no prompt group's rewards have differed for 2 steps") == 1 and "step 2:" in text
    assert [r["groups_with_spread"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"] == [0.0, 0.0, 0.0]


def test_docs_name_the_extras_each_recipe_needs():
    reproduce = (ROOT / "docs" / "reproduce.md").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[ray]'" in reproduce and "pip install -e '.[rewards]'" in reproduce
    assert "pip install -e '.[ray]'" in readme
