"""The digits-compose miniature (GenEval-style): the grammar, the detector-style gold judge on hand-made canvases
(closed forms per task type), the training reward's difference from it, the shipped assets and their recorded
numbers, and a recipe through the CLI."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from diffrl.sampling.evaluation import eval_prompts_and_seeds, score_images
from diffrl.sampling.evaluator import evaluate
from pipelines.digits_compose import COMPOSE_ASSET_DIR, DigitsComposeAdapter
from rewards.base import build_reward, call_reward
from rewards.digits.compose import (
    MAX_WORDS,
    RULES,
    TASKS,
    WORDS,
    default_prompts,
    exact_clauses,
    layout,
    load_digits_12,
    make_prompt,
    parse,
    probability_clauses,
    render,
    slot_relation,
    soft_clauses,
    tag,
    to_uint8,
)
from rewards.digits.compose_judge import ComposeJudgeNet, detect_components
from rewards.digits.data import ASSET_DIR, COLOUR_NAMES, DIGIT_WORDS, split_indices

pytestmark = pytest.mark.usefixtures("single_thread")
RED, GREEN, BLUE = (COLOUR_NAMES.index(c) for c in ("red", "green", "blue"))
JUDGE_SPLIT_SEED = 77


# -- grammar -------------------------------------------------------------------------------------------------
def test_grammar_round_trips_and_names_bad_prompts():
    prompts = default_prompts()
    assert len(prompts) == 60 and len(set(prompts)) == 60
    assert [tag(p) for p in prompts] == [t for t in TASKS for _ in range(10)]
    for p in prompts:
        assert make_prompt(parse(p)) == p and len(p.split()) <= MAX_WORDS and set(p.split()) <= set(WORDS)
    assert parse("three sevens") == {"tag": "counting", "include": [{"class": "seven", "count": 3}], "exclude": [{"class": "seven", "count": 4}]}
    assert parse("a red two and a blue five")["include"] == [{"class": "two", "count": 1, "color": "red"}, {"class": "five", "count": 1, "color": "blue"}]
    assert parse("a four left of a one") == {"tag": "position", "include": [{"class": "one", "count": 1}, {"class": "four", "count": 1, "position": ["left of", 0]}], "exclude": []}
    assert [tag(p) for p in ("a one", "an eight", "a green four", "a two and a five")] == ["single_object", "single_object", "colors", "two_object"]
    for bad in ("a purple seven", "an one", "a eight", "five sevens", "a two and a two", "a red four left of a one", "a red two and a five"):
        with pytest.raises(ValueError, match="none of"):
            parse(bad)


# -- hand-made canvases -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def held():
    """The first held-out digit (judge's split) of each class: ``{digit: intensity [1, 12, 12]}``."""
    intensity, labels = load_digits_12()
    idx = split_indices(len(labels), JUDGE_SPLIT_SEED)[1]
    return {d: intensity[idx[labels[idx] == d][0]] for d in range(10)}


def canvas(held, *objects):
    """uint8 ``[3, 32, 32]`` with ``(slot, digit, colour)`` objects."""
    return to_uint8(render(list(objects), [held[d] for _, d, _ in objects]))


def gold(images, prompts):
    return call_reward("digits_compose_gold", build_reward("digits_compose_gold"), torch.stack(images), prompts)["digits_compose_gold"]


def test_gold_judge_closed_forms_per_task_type(held):
    cases = [  # (prompt, canvas, expected) — GenEval's rules
        ("a seven", canvas(held, (0, 7, RED)), 1), ("a seven", canvas(held, (3, 2, RED)), 0), ("a seven", canvas(held), 0),
        ("a seven", canvas(held, (1, 7, BLUE), (2, 3, GREEN)), 1),  # extra objects are allowed
        ("a green four", canvas(held, (2, 4, GREEN)), 1), ("a green four", canvas(held, (2, 4, RED)), 0),
        ("a two and a five", canvas(held, (0, 2, RED), (3, 5, RED)), 1), ("a two and a five", canvas(held, (0, 2, RED)), 0),
        ("three sevens", canvas(held, (0, 7, RED), (1, 7, BLUE), (3, 7, GREEN)), 1),
        ("three sevens", canvas(held, (0, 7, RED), (1, 7, BLUE)), 0),  # too few
        ("three sevens", canvas(held, (0, 7, RED), (1, 7, BLUE), (2, 7, RED), (3, 7, GREEN)), 0),  # exact counts
        ("three sevens", canvas(held, (0, 7, RED), (1, 7, BLUE), (2, 1, RED), (3, 7, GREEN)), 1),  # other digits allowed
        ("a red two and a blue five", canvas(held, (0, 2, RED), (1, 5, BLUE)), 1),
        ("a red two and a blue five", canvas(held, (0, 2, BLUE), (1, 5, RED)), 0),  # colours swapped
        ("a four left of a one", canvas(held, (0, 4, RED), (1, 1, BLUE)), 1), ("a four left of a one", canvas(held, (1, 4, RED), (0, 1, BLUE)), 0),
        ("a four left of a one", canvas(held, (2, 4, RED), (1, 1, BLUE)), 1),  # diagonal: left of and below
        ("a four above a one", canvas(held, (1, 4, RED), (3, 1, BLUE)), 1), ("a four above a one", canvas(held, (0, 4, RED), (1, 1, BLUE)), 0),
        ("a four below a one", canvas(held, (3, 4, RED), (1, 1, BLUE)), 1), ("a four right of a one", canvas(held, (3, 4, RED), (2, 1, BLUE)), 1),
    ]
    prompts, images, expected = zip(*cases)
    assert gold(list(images), list(prompts)).tolist() == [float(e) for e in expected]
    # per task type: the gold's groups are the prompts' tags, and the evaluation's group means are each type's accuracy
    judge = build_reward("digits_compose_gold")
    assert judge.groups(list(prompts)) == [tag(p) for p in prompts]
    means = score_images(torch.stack(images), list(prompts), {"digits_compose_gold": judge})
    for task in ("single_object", "counting", "color_attr", "position"):
        own = [e for p, e in zip(prompts, expected) if tag(p) == task]
        assert means[f"eval/digits_compose_gold/{task}"] == pytest.approx(sum(own) / len(own)), task
    assert means["eval/digits_compose_gold"] == pytest.approx(sum(expected) / len(expected))


def test_detection_merge_min_area_and_colour_rules(held):
    blank = torch.zeros(3, 32, 32)
    bar = blank.clone()
    bar[0, 4:12, 4:6] = 1.0  # a red bar ...
    bar[0, 4:12, 8:10] = 1.0  # ... and another 2 px away: merged into one object
    assert [(o["area"], o["box"], COLOUR_NAMES[o["colour"]]) for o in detect_components(bar)] == [(32, [4.0, 4.0, 10.0, 12.0], "red")]
    bar[0, 4:12, 8:10] = 0.0
    bar[2, 4:12, 9:11] = 1.0  # a blue bar 3 px away: two objects
    assert [COLOUR_NAMES[o["colour"]] for o in detect_components(bar)] == ["red", "blue"]
    speck = blank.clone()
    speck[1, 20:22, 20:23] = 1.0  # 6 px < MIN_AREA
    assert detect_components(speck) == []
    dim = canvas(held, (0, 3, GREEN)).float() / 255.0 * 0.25  # under the foreground threshold
    assert detect_components(dim) == []


def test_training_reward_differs_from_the_judge(held):
    reward = build_reward("digits_compose")
    prompts = default_prompts()[::5]
    good = []  # canvases that satisfy each prompt
    g = torch.Generator().manual_seed(3)
    for p in prompts:
        objects = layout(parse(p), g)
        good.append(canvas(held, *objects))
    r = call_reward("digits_compose", reward, torch.stack(good), prompts)["digits_compose"]
    assert r.min() > 0.5 and r.mean() > 0.85 and gold(good, prompts).mean() == 1.0
    empty = torch.zeros(len(prompts), 3, 32, 32, dtype=torch.uint8)
    assert call_reward("digits_compose", reward, empty, prompts)["digits_compose"].max() < 0.1  # the occupancy sigmoid leaks a little
    # a blind spot: a seven drawn off the slot grid (straddling two slots) is a seven for the judge, not for the reward
    off = torch.zeros(3, 32, 32)
    off[:, 10:22, 10:22] = render([(0, 7, RED)], [held[7]])[:, 2:14, 2:14]
    off = to_uint8(off)
    assert gold([off], ["a seven"]).item() == 1.0
    assert call_reward("digits_compose", reward, off[None], ["a seven"])["digits_compose"].item() < 0.5



def _brute_force(meta: dict, occ: torch.Tensor, p_digit: torch.Tensor, p_colour: torch.Tensor) -> float:
    """GenEval's rule, read by every object of a class, summed over every joint slot content (13⁴ for two clauses)."""
    clauses = meta["include"]
    options = [None] + [(k, c) for k in range(len(clauses)) for c in range(len(COLOUR_NAMES))]
    table = [[1 - sum(float(occ[slot] * p_digit[slot, DIGIT_WORDS.index(c["class"])]) for c in clauses)]  # as floats
             + [float(occ[slot] * p_digit[slot, DIGIT_WORDS.index(clauses[k]["class"])] * p_colour[slot, c]) for k, c in options[1:]]
             for slot in range(4)]
    total = 0.0
    for state in itertools.product(range(len(options)), repeat=4):
        prob = table[0][state[0]] * table[1][state[1]] * table[2][state[2]] * table[3][state[3]]
        objects = [(slot, *options[o]) for slot, o in enumerate(state) if o >= 1]
        if meta["tag"] == "counting":
            ok = len(objects) == clauses[0]["count"]
        elif meta["tag"] == "position":
            targets, objs = [s for s, k, _ in objects if k == 0], [s for s, k, _ in objects if k == 1]
            ok = bool(targets and objs) and all(slot_relation(a, b, clauses[1]["position"][0]) for a in objs for b in targets)
        else:
            ok = all(any(k == j for _, k, _ in objects) and ("color" not in c or all(COLOUR_NAMES[col] == c["color"] for _, k, col in objects if k == j))
                     for j, c in enumerate(clauses))
        total += prob * ok
    return total


def test_probability_rule_is_genevals_rule_in_expectation_and_pays_nothing_for_hedging():
    g = torch.Generator().manual_seed(0)
    for prompt in ["a seven", "a green four", "three sevens", "a four left of a one", "a seven below a two", "a red two and a blue five", "a two and a five"]:
        occ = 0.5 + 0.5 * torch.rand(4, generator=g)
        p_digit, p_colour = (3 * torch.rand(4, 10, generator=g)).softmax(-1), (3 * torch.rand(4, 6, generator=g)).softmax(-1)
        expected = _brute_force(parse(prompt), occ, p_digit, p_colour)
        assert float(probability_clauses(parse(prompt), occ, p_digit, p_colour)) == pytest.approx(expected, rel=1e-4, abs=1e-9), prompt
    # hedging: four ambiguous sevens (0.75 each) are "three sevens" for the soft rule, 4·0.75³·0.25 for the probability rule
    sevens = torch.zeros(4, 10)
    sevens[:, 7], sevens[:, 1] = 0.75, 0.25
    colours = torch.full((4, 6), 1 / 6)
    assert float(soft_clauses(parse("three sevens"), torch.ones(4), sevens, colours)) == 1.0
    assert float(probability_clauses(parse("three sevens"), torch.ones(4), sevens, colours)) == pytest.approx(4 * 0.75**3 * 0.25, rel=1e-6)
    # a sure green four next to a sure red four: "a green four" fully for the soft rule, 0 for the probability rule
    fours, two_colours = torch.zeros(4, 10), torch.zeros(4, 6)
    fours[:2, 4] = 1.0
    two_colours[0, GREEN], two_colours[1, RED] = 1.0, 1.0
    occ = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert float(soft_clauses(parse("a green four"), occ, fours, two_colours)) == 1.0
    assert float(probability_clauses(parse("a green four"), occ, fours, two_colours)) == 0.0
    # a four left of the one (slot 0 | slot 1) and another below-right of it (slot 3): the soft rule takes the best
    # pair, the probability rule asks every four to be left of the one (GenEval reads the most confident four)
    hedge = torch.zeros(4, 10)
    hedge[0, 4], hedge[1, 1], hedge[2, 0], hedge[3, 4] = 1.0, 1.0, 1.0, 1.0
    assert float(soft_clauses(parse("a four left of a one"), torch.ones(4), hedge, colours)) == 1.0
    assert float(probability_clauses(parse("a four left of a one"), torch.ones(4), hedge, colours)) == 0.0
    hedge[3, 4], hedge[3, 0] = 0.0, 1.0  # the second four is a zero now
    assert float(probability_clauses(parse("a four left of a one"), torch.ones(4), hedge, colours)) == 1.0
    assert sorted(RULES) == ["exact", "probability", "soft"]
    with pytest.raises(ValueError, match="rule 'exactly' is unknown; set \\+reward.options.digits_compose.rule"):
        build_reward("digits_compose", rule="exactly")


def _brute_force_exact(meta: dict, occ: torch.Tensor, p_digit: torch.Tensor, p_colour: torch.Tensor) -> float:
    """"Exactly the named objects and nothing else", summed over every joint slot content: each slot empty, a named
    digit in each colour, or anything else (14⁴ contents)."""
    clauses = meta["include"]
    options = ["empty", "other"] + [(k, c) for k in range(len(clauses)) for c in range(len(COLOUR_NAMES))]
    named = [sum(float(occ[slot] * p_digit[slot, DIGIT_WORDS.index(c["class"])]) for c in clauses) for slot in range(4)]
    table = [[1 - float(occ[slot]), float(occ[slot]) - named[slot]]  # each slot's probability of each option, as floats
             + [float(occ[slot] * p_digit[slot, DIGIT_WORDS.index(clauses[k]["class"])] * p_colour[slot, c]) for k, c in options[2:]]
             for slot in range(4)]
    total = 0.0
    for state in itertools.product(range(len(options)), repeat=4):
        prob = table[0][state[0]] * table[1][state[1]] * table[2][state[2]] * table[3][state[3]]
        objects = [(slot, *options[o]) for slot, o in enumerate(state) if o >= 2]
        if 1 in state:  # an object that is none of the named ones
            continue
        right = [(slot, k) for slot, k, col in objects if "color" not in clauses[k] or COLOUR_NAMES[col] == clauses[k]["color"]]
        ok = len(right) == len(objects) and all(sum(kk == k for _, kk in right) == c["count"] for k, c in enumerate(clauses))
        if ok and meta["tag"] == "position":
            ok = slot_relation(next(s for s, k in right if k == 1), next(s for s, k in right if k == 0), clauses[1]["position"][0])
        total += prob * ok
    return total


def test_exact_rule_pays_for_exactly_the_named_objects():
    """Rule ``exact`` (issue 53): the probability, under the classifier's per-slot reading, that the canvas holds the
    named digits in the named number, colours and relation and nothing else; equal to the sum over every slot content,
    and no credit for extra copies, an unnamed digit or a wrong colour, where GenEval's rule gives full credit."""
    g = torch.Generator().manual_seed(1)
    for prompt in ["a seven", "a green four", "three sevens", "two ones", "a four left of a one", "a seven below a two",
                   "a red two and a blue five", "a two and a five"]:
        occ = torch.rand(4, generator=g)
        logits = 3 * torch.rand(4, 10, generator=g)
        logits[:, [DIGIT_WORDS.index(c["class"]) for c in parse(prompt)["include"]]] += 3.0  # readings that often hold the prompt
        p_digit, p_colour = logits.softmax(-1), (3 * torch.rand(4, 6, generator=g)).softmax(-1)
        expected = _brute_force_exact(parse(prompt), occ, p_digit, p_colour)
        assert expected > 1e-4, prompt  # a sum the rule must reproduce, not two zeros
        assert float(exact_clauses(parse(prompt), occ, p_digit, p_colour)) == pytest.approx(expected, rel=1e-4), prompt
    sevens, colours = torch.zeros(4, 10), torch.full((4, 6), 1 / 6)
    sevens[:, 7] = 1.0
    one, two, four = torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 1, 0, 0]), torch.ones(4)
    # one sure seven on an empty canvas is "a seven"; two or four of them are not (GenEval's rule pays all three)
    assert [float(exact_clauses(parse("a seven"), o, sevens, colours)) for o in (one, two, four)] == [1.0, 0.0, 0.0]
    assert [float(probability_clauses(parse("a seven"), o, sevens, colours)) for o in (one, two, four)] == [1.0, 1.0, 1.0]
    assert float(exact_clauses(parse("two sevens"), two, sevens, colours)) == 1.0
    # a slot half seven, half one: "a seven" with probability 1/2
    hedged = sevens.clone()
    hedged[0, 7], hedged[0, 1] = 0.5, 0.5
    assert float(exact_clauses(parse("a seven"), one, hedged, colours)) == pytest.approx(0.5)
    # a sure green four and a sure red four: neither "a green four" nor "a red four" exactly
    fours, two_colours = torch.zeros(4, 10), torch.zeros(4, 6)
    fours[:2, 4] = 1.0
    two_colours[0, GREEN], two_colours[1, RED] = 1.0, 1.0
    assert float(exact_clauses(parse("a green four"), two, fours, two_colours)) == 0.0
    assert float(exact_clauses(parse("a green four"), one, fours, two_colours)) == 1.0
    # position: the relation decides; a diagonal pair satisfies both relations of its axes, as GenEval reads it
    pair = torch.zeros(4, 10)
    pair[0, 4], pair[3, 1] = 1.0, 1.0
    diagonal = torch.tensor([1.0, 0, 0, 1])
    assert float(exact_clauses(parse("a four left of a one"), diagonal, pair, colours)) == 1.0
    assert float(exact_clauses(parse("a four above a one"), diagonal, pair, colours)) == 1.0
    assert float(exact_clauses(parse("a four right of a one"), diagonal, pair, colours)) == 0.0
    # real canvases, read by the shipped classifier: one drawn seven pays, a second copy takes the pay away (not under "soft")
    digits, labels = load_digits_12()
    seven = digits[(labels == 7).nonzero()[0, 0]]
    canvases = torch.stack([to_uint8(render(objects, [seven] * len(objects))) for objects in ([(0, 7, GREEN)], [(0, 7, GREEN), (3, 7, RED)])])
    exact = build_reward("digits_compose", rule="exact")(canvases, ["a seven"] * 2)["digits_compose"]
    soft = build_reward("digits_compose")(canvases, ["a seven"] * 2)["digits_compose"]
    assert exact[0] > 0.5 and exact[1] < 0.1 and soft[1] > 0.5, (exact, soft)

# -- assets ---------------------------------------------------------------------------------------------------
def test_shipped_files_are_small_and_the_judge_is_independent():
    files = [p for p in COMPOSE_ASSET_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 10 * 2**20
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors", "judge/model.safetensors", "metadata.json", "pretrain_log.txt"):
        assert (COMPOSE_ASSET_DIR / part).is_file(), part
    judge_meta = json.loads((COMPOSE_ASSET_DIR / "judge" / "metadata.json").read_text())
    reward_meta = json.loads((ASSET_DIR / "metadata.json").read_text())["reward_classifier"]
    assert judge_meta["seed"] != reward_meta["seed"] and judge_meta["split_seed"] not in (reward_meta["split_seed"], 44)  # nor the generator's split
    assert reward_meta["architecture"] == "cnn" and isinstance(build_reward("digits_compose_gold").model, ComposeJudgeNet)
    assert judge_meta["held_out"]["digit_accuracy"] >= 0.97 and min(judge_meta["held_out_canvases"].values()) >= 0.9


def _evaluate(adapter, prompts, seeds, num_steps, metrics):
    return evaluate(adapter, prompts, seeds=seeds, num_steps=num_steps, guidance_scale=1.0, metrics=metrics, height=32, width=32)[0]


# the shipped asset's published base numbers over the recipes' whole evaluation (a published-numbers check, like the
# default recipe's): the slow tier, and still rerun under other kernels (explicitly `numerics`)
@pytest.mark.slow(seconds=10)
@pytest.mark.numerics
def test_base_numbers_reproduce_and_are_weak_on_the_hard_types():
    adapter = DigitsComposeAdapter(path=str(COMPOSE_ASSET_DIR))
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), 4, 1234)  # the trainer's evaluation
    scores = _evaluate(adapter, prompts, seeds, 10, {n: build_reward(n) for n in ("digits_compose", "digits_compose_gold")})
    base = json.loads((COMPOSE_ASSET_DIR / "metadata.json").read_text())["base"]
    assert set(scores) == {f"eval/{k}" for k in base} and len(base) == 2 + len(TASKS)
    for key, value in base.items():  # float32 networks: other CPUs' kernels (AVX-512 vs AVX2) move a mean by ~1e-6
        assert abs(scores[f"eval/{key}"] - value) < 2e-5, key
    assert scores["eval/digits_compose_gold"] <= 0.6  # room for RL
    easy = min(base[f"digits_compose_gold/{t}"] for t in ("single_object", "colors"))
    assert all(base[f"digits_compose_gold/{t}"] < easy for t in ("counting", "color_attr", "position"))


# -- the recipe -------------------------------------------------------------------------------------------------
def test_recipe_trains_two_steps_and_evaluates_like_the_base_evaluation(tmp_path):
    from diffrl.tools.cli import main

    out = tmp_path / "run"
    rc = main([
        "train", "experiment=digits_compose_flow_grpo", "trainer.steps=2", f"trainer.output_dir={out}", "trainer.wandb=disabled",
        "trainer.progress=false", "trainer.prompts_per_step=2", "trainer.group_size=2", "sampler.num_steps=2",
        "sampler.eval_num_steps=2", "eval.every=2", "eval.seeds_per_prompt=1", "trainer.checkpoint_every=0",
    ])
    assert rc in (0, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(0.0 <= r["reward/digits_compose_mean"] <= 1.0 for r in train)
    summary = json.loads((out / "summary.json").read_text())
    adapter = DigitsComposeAdapter(path=str(COMPOSE_ASSET_DIR))
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), 1, 1234)
    options = {"digits_compose": {"rule": "exact"}}  # the reward group's (configs/reward/digits_compose.yaml)
    expected = _evaluate(adapter, prompts, seeds, 2, {n: build_reward(n, **options.get(n, {})) for n in ("digits_compose", "digits_compose_gold")})
    assert "eval/digits_compose_gold/counting" in expected
    for key, value in expected.items():
        assert summary["eval_before"][key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow(seconds=21)
def test_pretraining_weights_do_not_depend_on_how_often_it_evaluates(tmp_path):
    """The shipped base was made with --eval-every 500; the defaults evaluate less often and must give the same weights."""
    import hashlib
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    digests = []
    for every in (3, 6):
        out = tmp_path / f"every{every}"
        cmd = [sys.executable, "scripts/pretrain_digits_compose.py", "--out", str(out), "--judge", str(COMPOSE_ASSET_DIR / "judge"),
               "--max-steps", "6", "--batch-size", "4", "--eval-every", str(every), "--eval-seeds", "1", "--threads", "1"]
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
        meta = json.loads((out / "metadata.json").read_text())
        assert [h["step"] for h in meta["generator"]["history"]] == list(range(every, 7, every))
        digests.append([hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*/*.safetensors"))])
    assert len(digests[0]) == 2 and digests[0] == digests[1]
