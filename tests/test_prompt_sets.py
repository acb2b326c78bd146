"""Built-in prompt sets (``diffrl.prompt_sets``): determinism (pinned checksums), split sizes and GenEval's task
counts, disjoint splits, GenEval rows that parse back and pass / fail ``rewards.geneval.check`` as they should,
OCR targets that are the quoted text and reach the OCR reward, lexical diversity of ``general``, bad names."""

from __future__ import annotations

import hashlib
import time
from collections import Counter

import pytest
import torch

from diffrl.prompt_sets import PROMPT_SETS, is_prompt_set, load_prompt_set, prompt_set_names
from diffrl.prompt_sets import geneval as geneval_set
from rewards.geneval import COLORS, check, parse_prompt, relative_position
from rewards.ocr import OcrReward, normalise_text, quoted_text

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

GENEVAL_TAG_COUNTS = {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100, "color_attr": 100}
SIZES = {"geneval": {"train": 2765, "test": 553}, "ocr": {"train": 5000, "test": 1000}, "general": {"train": 2000, "test": 500}}
# sha256 of "\n".join(prompts), first 16 hex digits: a generator change (or a new Python `random`) shows here
CHECKSUMS = {
    ("geneval", "train"): "8b7b5ef36da325f8", ("geneval", "test"): "236e0d5fd61b9210",
    ("ocr", "train"): "4ff871bc9ca4b388", ("ocr", "test"): "f2c9c5ca24912bf1",
    ("general", "train"): "6e48b1714dd9dbae", ("general", "test"): "d9089718b3e02525",
}
CASES = [(name, split) for name in SIZES for split in ("train", "test")]


def checksum(prompts: list[str]) -> str:
    return hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]


def test_registry_and_sizes():
    assert prompt_set_names() == ["general", "geneval", "ocr"]
    assert is_prompt_set("geneval") and not is_prompt_set("prompts/geneval.txt") and not is_prompt_set("GenEval")
    for name, split in CASES:
        prompts, metadata = load_prompt_set(name, split)
        assert len(prompts) == SIZES[name][split] == PROMPT_SETS[name].splits[split]
        assert (metadata is None) == (not PROMPT_SETS[name].metadata) == (name == "general")
        assert metadata is None or len(metadata) == len(prompts)
        assert PROMPT_SETS[name].provenance and "\n" not in PROMPT_SETS[name].provenance


@pytest.mark.parametrize("name,split", CASES)
def test_deterministic_with_pinned_checksum(name, split):
    first, second = load_prompt_set(name, split), load_prompt_set(name, split)
    assert first == second
    if first[1] is not None:  # callers get copies: mutating one does not change the next load
        first[1][0]["mutated"] = True
        first[0][0] = "changed"
        assert load_prompt_set(name, split) == second
    assert checksum(second[0]) == CHECKSUMS[(name, split)]


def test_fast():
    for module in (PROMPT_SETS[name].module for name in SIZES):
        module.build.cache_clear()
    start = time.perf_counter()
    for name, split in CASES:
        load_prompt_set(name, split)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("name", list(SIZES))
def test_splits_disjoint_without_duplicates(name):
    (train, train_meta), (test, test_meta) = load_prompt_set(name, "train"), load_prompt_set(name, "test")
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    if name == "ocr":
        train_texts, test_texts = {normalise_text(m["text"]) for m in train_meta}, {normalise_text(m["text"]) for m in test_meta}
        assert len(train_texts) == len(train) and len(test_texts) == len(test) and not train_texts & test_texts


def test_geneval_task_counts_and_proportions():
    _, test = load_prompt_set("geneval", "test")
    _, train = load_prompt_set("geneval", "train")
    assert len(test) == 553 and Counter(r["tag"] for r in test) == GENEVAL_TAG_COUNTS
    counts = Counter(r["tag"] for r in train)
    for tag, n in GENEVAL_TAG_COUNTS.items():
        assert abs(counts[tag] / len(train) - n / 553) < 0.01, tag
    assert sorted({r["include"][0]["class"] for r in test if r["tag"] == "single_object"}) == sorted(geneval_set.COCO_CLASSES)
    assert all(r["prompt"].startswith("a photo of ") for r in test)
    assert {r["include"][0]["count"] for r in test + train if r["tag"] == "counting"} == {2, 3, 4}


def test_geneval_train_holds_out_test_compositions():
    _, test = load_prompt_set("geneval", "test")
    _, train = load_prompt_set("geneval", "train")
    for tag in ("two_object", "position", "color_attr", "colors", "counting"):
        keys = [{geneval_set.composition_key(tag, c) for c in geneval_set._test_contents(rows, tag)} for rows in (test, train)]
        assert keys[0] and keys[1] and not keys[0] & keys[1], tag


def test_geneval_plurals_parse_back():
    for name in geneval_set.COCO_CLASSES:  # every class, horses, suitcases and vases included
        row = geneval_set.make_row("counting", (name, 3))
        assert parse_prompt(row["prompt"])["include"][0]["class"] == name, row["prompt"]
    assert geneval_set.plural("person") == "people" and geneval_set.plural("wine glass") == "wine glasses"
    assert geneval_set.plural("knife") == "knives" and geneval_set.plural("sheep") == "sheep"


# --- synthetic detections ------------------------------------------------------------------------------
OFFSETS = {"left of": (-80, 0), "right of": (80, 0), "above": (0, -80), "below": (0, 80)}


def detections(meta: dict) -> dict[str, list[dict]]:
    """Boxes that satisfy ``meta``: exact counts, the asked colours, each object placed in its relation to its
    target (target at (200, 200)–(240, 240), the object 80 px away); unpositioned objects on separate rows."""
    found: dict[str, list[dict]] = {}
    for i, clause in enumerate(meta["include"]):
        objects = []
        for k in range(clause["count"]):
            if "position" in clause:
                dx, dy = OFFSETS[clause["position"][0]]
                box = [200 + dx, 200 + dy, 240 + dx, 240 + dy]
            else:
                box = [200 + 60 * k, 200 + 300 * i, 240 + 60 * k, 240 + 300 * i]
            obj = {"box": box, "score": 0.9}
            if "color" in clause:
                obj["color"] = clause["color"]
            objects.append(obj)
        found.setdefault(clause["class"], []).extend(objects)
    return found


def test_geneval_rows_parse_and_check():
    for split in ("train", "test"):
        prompts, rows = load_prompt_set("geneval", split)
        for prompt, row in zip(prompts, rows):
            assert row["prompt"] == prompt and set(row) == {"tag", "include", "exclude", "prompt"}
            meta = {k: row[k] for k in ("tag", "include", "exclude")}
            assert parse_prompt(prompt) == meta, prompt
            good = detections(meta)
            assert check(good, meta) == (1.0, True, []), prompt
            # one object fewer: the first clause's class misses one
            first = meta["include"][0]["class"]
            dropped = {**good, first: good[first][:-1]}
            assert check(dropped, meta)[1] is False, prompt
            if meta["exclude"]:  # counting: one object too many breaks the exclude clause
                assert check({**good, first: good[first] + good[first][:1]}, meta)[1] is False, prompt
            colored = [c for c in meta["include"] if "color" in c]
            if colored:
                cls = colored[0]["class"]
                other = COLORS[(COLORS.index(colored[0]["color"]) + 1) % len(COLORS)]
                flipped = {**good, cls: [{**good[cls][0], "color": other}] + good[cls][1:]}
                assert check(flipped, meta)[1] is False, prompt
            positioned = [c for c in meta["include"] if "position" in c]
            if positioned:
                cls, target = positioned[0]["class"], meta["include"][positioned[0]["position"][1]]["class"]
                box, tbox = good[cls][0]["box"], good[target][0]["box"]
                cx, cy = (tbox[0] + tbox[2]) / 2, (tbox[1] + tbox[3]) / 2  # the object mirrored through the target's centre
                mirrored = [2 * cx - box[2], 2 * cy - box[3], 2 * cx - box[0], 2 * cy - box[1]]
                swapped = {**good, cls: [{**good[cls][0], "box": mirrored}]}
                assert positioned[0]["position"][0] not in relative_position(mirrored, tbox)
                assert check(swapped, meta)[1] is False, prompt


def test_ocr_targets_are_the_quoted_text():
    for split in ("train", "test"):
        prompts, rows = load_prompt_set("ocr", split)
        lengths = Counter(len(row["text"].split()) for row in rows)
        assert set(lengths) <= {1, 2, 3, 4} and len(lengths) == 4
        for prompt, row in zip(prompts, rows):
            assert set(row) == {"text"} and quoted_text(prompt) == row["text"], prompt
        cases = Counter("upper" if row["text"].isupper() else "mixed" for row in rows)
        assert min(cases.values()) > 0.3 * len(rows)


def test_ocr_reward_uses_metadata_text(monkeypatch):
    reward = OcrReward.__new__(OcrReward)  # no OCR engine: `read` is stubbed
    reward.min_confidence = 0.5
    monkeypatch.setattr(OcrReward, "read", lambda self, image: "OPEN LATE")
    images = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    prompts = ['a sign that reads "CLOSED"', 'a sign that reads "CLOSED"']
    assert reward(images, prompts)["ocr"].tolist() == [0.0, 0.0]  # no metadata: the quoted text is the target
    out = reward(images, prompts, [{"text": "OPEN LATE"}, {"text": "open  late"}])["ocr"]
    assert out.tolist() == [1.0, 1.0]
    # metadata that is not one {"text": …} row per image (the trainer's {"step": …}) keeps the quoted text
    assert reward(images, prompts, {"step": 3})["ocr"].tolist() == [0.0, 0.0]
    assert reward(images, prompts, [{"text": "OPEN LATE"}])["ocr"].tolist() == [0.0, 0.0]
    prompts, rows = load_prompt_set("ocr", "test")
    monkeypatch.setattr(OcrReward, "read", lambda self, image: rows[0]["text"])
    assert reward(images[:1], prompts[:1], rows[:1])["ocr"].tolist() == [1.0]


def test_general_diverse():
    train, _ = load_prompt_set("general", "train")
    test, _ = load_prompt_set("general", "test")
    prompts = train + test
    assert len(prompts) >= 1000 and len(set(prompts)) == len(prompts)
    prefixes = {" ".join(p.split()[:3]) for p in prompts}
    assert len(prefixes) >= 0.3 * len(prompts)
    first_words = Counter(p.split()[0] for p in prompts)
    assert first_words.most_common(1)[0][1] < 0.5 * len(prompts)  # not one opening word throughout


@pytest.mark.parametrize("name,split,match", [("laion", "train", "general, geneval, ocr"), ("geneval", "val", "train, test"),
                                              ("ocr", "TEST", "train, test")])
def test_bad_name_or_split(name, split, match):
    with pytest.raises(ValueError, match=match) as info:
        load_prompt_set(name, split)
    assert "\n" not in str(info.value)
