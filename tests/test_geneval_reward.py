"""The ``geneval`` reward (GenEval's rules on OWLv2 detections): the prompt grammar, GenEval's relation rule and
clause checks by closed forms, the detection post-processing on hand-set detector outputs, and the whole reward
on a tiny random OWLv2."""

from __future__ import annotations

import pytest
import torch

from diffrl.hub import HubError
from rewards.base import RewardError, build_reward, score
from rewards.geneval import COLORS, GenEvalOwl, check, parse_prompt, relative_position, singular

TINY = {
    "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 16},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 64, "patch_size": 16},
    "projection_dim": 32,
}


def test_prompts_parse_to_genevals_metadata():
    assert parse_prompt("a photo of a bench") == {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "exclude": []}
    assert parse_prompt("a photo of a red car") == {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "exclude": []}
    assert parse_prompt("a photo of three cups") == {"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]}
    assert parse_prompt("a photo of a bench and a cow") == {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "cow", "count": 1}], "exclude": []}
    assert parse_prompt("a photo of a red car and a blue bench")["tag"] == "color_attr"
    assert parse_prompt("a photo of a dog right of a teddy bear") == {
        "tag": "position", "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}], "exclude": []}
    assert [singular(w) for w in ("cups", "benches", "buses", "wine glasses", "people", "skis", "bananas", "teddy bears")] == [
        "cup", "bench", "bus", "wine glass", "person", "skis", "banana", "teddy bear"]
    with pytest.raises(RewardError, match="cannot parse 'several cats'"):
        parse_prompt("several cats")


def test_relative_position_closed_forms():
    a = (0, 0, 10, 10)
    # offset (−20, 0), shrunk by 0.1·(10 + 10) = 2 → (−18, 0) / 20: dx = −0.9
    assert relative_position(a, (20, 0, 30, 10)) == {"left of"} and relative_position((20, 0, 30, 10), a) == {"right of"}
    # overlapping: |offset| 1 < margin 2 → no relation
    assert relative_position(a, (1, 0, 11, 10)) == set()
    # diagonal: (−18, −18) / 28.28 = −0.636 on both axes (y grows downwards)
    assert relative_position(a, (20, 20, 30, 30)) == {"left of", "above"}
    assert relative_position(a, (0, 30, 10, 40)) == {"above"}
    # a wider margin swallows the 20-pixel gap: threshold 1.0 shrinks by 20
    assert relative_position(a, (20, 0, 30, 10), threshold=1.0) == set()


def _obj(box, color=None, score=0.9):
    return {"box": list(box), "score": score, **({"color": color} if color else {})}


def test_clause_checks_follow_genevals_rules():
    three = parse_prompt("three cups")
    cups = [_obj((i * 20, 0, i * 20 + 10, 10)) for i in range(4)]
    assert check({"cup": cups[:3]}, three) == (1.0, True, [])
    frac, ok, reasons = check({"cup": cups}, three)  # four found: the exclude clause fails
    assert (frac, ok) == (0.5, False) and reasons == ["expected cup < 4, found 4"]
    assert check({"cup": cups[:2]}, three)[:2] == (0.5, False)  # two found: the include clause fails, the exclude holds
    attr = parse_prompt("a red car and a blue bench")
    assert check({"car": [_obj((0, 0, 5, 5), "red")], "bench": [_obj((9, 9, 19, 19), "blue")]}, attr)[:2] == (1.0, True)
    assert check({"car": [_obj((0, 0, 5, 5), "blue")], "bench": [_obj((9, 9, 19, 19), "blue")]}, attr)[:2] == (0.5, False)
    # colour and position are judged on the most confident objects only
    assert check({"car": [_obj((0, 0, 5, 5), "blue"), _obj((0, 0, 5, 5), "red")], "bench": [_obj((9, 9, 19, 19), "blue")]}, attr)[0] == 0.5
    pos = parse_prompt("a dog left of a cat")
    cat = _obj((40, 0, 50, 10))
    assert check({"dog": [_obj((0, 0, 10, 10))], "cat": [cat]}, pos)[:2] == (1.0, True)
    assert check({"dog": [_obj((80, 0, 90, 10))], "cat": [cat]}, pos)[:2] == (0.5, False)
    frac, ok, reasons = check({"dog": [_obj((0, 0, 10, 10))]}, pos)  # no target: both clauses fail
    assert (frac, ok) == (0.0, False) and reasons == ["expected cat ≥ 1, found 0", "no target for dog to be left of"]
    assert check({}, parse_prompt("a bench and a cow"))[0] == 0.0


@pytest.fixture(scope="module")
def reward():
    return GenEvalOwl(random_init=True, model_config=TINY, threshold=0.5, counting_threshold=0.8, nms_iou=0.5)


def test_detection_post_processing_on_set_detector_outputs(reward, monkeypatch):
    """Scores [boxes, queries] and boxes as the detector would give them → thresholds, NMS, order, colours."""
    boxes = torch.tensor([[0, 0, 10, 10], [1, 0, 11, 10], [30, 0, 40, 10], [60, 0, 70, 10]], dtype=torch.float32)
    spec = parse_prompt("a red car and a blue bench")
    queries_seen = []

    def forward(image, queries):
        queries_seen.append(queries)
        s = torch.zeros(4, len(queries))
        column = {q: i for i, q in enumerate(queries)}
        s[:, column["a photo of a car"]] = torch.tensor([0.9, 0.8, 0.6, 0.4])  # box 1 overlaps box 0 (IoU 9/11 ≥ 0.5) → NMS; box 3 below 0.5
        if "a photo of a bench" in column:
            s[:, column["a photo of a bench"]] = torch.tensor([0.1, 0.1, 0.2, 0.95])  # box 3 only
            s[0, column["a photo of a red car"]] = 0.7  # car colours: box 0 red, box 2 blue
            s[2, column["a photo of a blue car"]] = 0.7
            s[3, column["a photo of a blue bench"]] = 0.6
        return s, boxes

    monkeypatch.setattr(reward, "_forward", forward)
    found = reward.detect(torch.zeros(3, 80, 80, dtype=torch.uint8), spec)
    assert queries_seen[0][:2] == ["a photo of a car", "a photo of a bench"] and len(queries_seen[0]) == 2 + 2 * len(COLORS)
    assert [(o["box"], o["color"]) for o in found["car"]] == [([0, 0, 10, 10], "red"), ([30, 0, 40, 10], "blue")]
    assert [(o["box"], o["color"]) for o in found["bench"]] == [([60, 0, 70, 10], "blue")]
    out = reward(torch.zeros(2, 3, 80, 80, dtype=torch.uint8), ["a red car and a blue bench", "a blue car and a blue bench"])
    assert out["geneval"].tolist() == [1.0, 0.5] and out["geneval_strict"].tolist() == [1.0, 0.0]
    # counting uses counting_threshold 0.8: car boxes 0 (0.9) and 1 (0.8 is not above it) → one car
    assert reward.detect(torch.zeros(3, 80, 80, dtype=torch.uint8), parse_prompt("two cars"))["car"] == [_obj((0, 0, 10, 10), score=pytest.approx(0.9))]
    # GenEval metadata rows given as metadata win over the prompt
    rows = [{"tag": "single_object", "include": [{"class": "car", "count": 1}], "exclude": []}]
    assert reward(torch.zeros(1, 3, 80, 80, dtype=torch.uint8), ["not a parseable prompt at all"], rows)["geneval"].tolist() == [1.0]


def test_the_tiny_random_detector_runs_end_to_end_through_the_registry():
    images = torch.randint(0, 256, (3, 3, 48, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    prompts = ["a photo of a dog left of a cat", "a photo of two cups", "a photo of a red car"]
    fn = build_reward("geneval", random_init=True, model_config=TINY, threshold=0.0, counting_threshold=0.0)
    out = fn(images, prompts)
    assert set(out) == {"geneval", "geneval_strict"} and out["geneval"].shape == (3,)
    assert ((out["geneval"] >= 0) & (out["geneval"] <= 1)).all() and set(out["geneval_strict"].tolist()) <= {0.0, 1.0}
    assert (out["geneval_strict"] <= out["geneval"]).all()
    # threshold 0 keeps up to max_objects (16) boxes of every class: the counting prompt fails its exclude clause
    assert out["geneval"][1] == 0.5
    scored = score({"geneval": (fn, 2.0)}, images, prompts)
    assert torch.equal(scored["rewards"], 2.0 * out["geneval"]) and torch.equal(scored["reward/geneval_strict"], out["geneval_strict"])
    with pytest.raises(HubError, match=r"reward.options.geneval.checkpoint=google/owlv2-base-patch16-ensemble: .*hf download google/owlv2"):
        build_reward("geneval")  # the published weights by default; offline with an empty cache: the fetch command
    with pytest.raises(ValueError, match="threshold must be in"):
        GenEvalOwl(random_init=True, model_config=TINY, threshold=1.5)


def test_groups_are_genevals_task_types(reward):
    prompts = ["a photo of a cat", "a photo of a red car", "a photo of three dogs", "a photo of a cat and a dog",
               "a photo of a red car and a blue bench", "a photo of a dog left of a cat", "a photo of a cat and a dog and a car", "a photo of a cat, a dog and a car"]
    assert reward.groups(prompts) == ["single_object", "colors", "counting", "two_object", "color_attr", "position", None, None]
    with pytest.raises(RewardError, match="lists objects with commas"):
        parse_prompt("a photo of a cat, a dog and a car")
