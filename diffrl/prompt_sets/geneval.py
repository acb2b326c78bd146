"""``geneval``: GenEval-format compositional prompts with metadata rows, from diffrl's own seeded generator.

Every row is a GenEval ``evaluation_metadata.jsonl`` row, ``{"tag", "include", "exclude", "prompt"}``, over
GenEval's six task types, COCO's 80 object classes (GenEval's names) and GenEval's ten colours, worded with
GenEval's templates ("a photo of a bench", "a photo of three cups", "a photo of a dog right of a cat").

* **test** (553 rows): the size and per-task counts of GenEval's evaluation set, all worded "a photo of …"
  with "a"/"an"; single_object names each of the 80 classes once, as GenEval does.
* **train** (5 × the test count of every task type, 2,765 rows): no prompt text in common with the test split.
  Compositions (two_object, position, color_attr, colors, counting) never repeat a test composition, with the
  left/right and above/below mirror of a position counting as the same one. single_object cannot avoid the
  test's classes (the test names all 80), so its train rows are the 80 classes in the other five wordings
  ("an image of …", "a picture of …", "one" for "a"), five rows a class; counting takes the held-out
  (class, number) pairs in the three prefixes.

Counting uses 2–4 objects (GenEval's range), with correct English plurals for all 80 classes (each parses back
through ``rewards.geneval.singular``: tested).
"""

from __future__ import annotations

import functools
import random

SEED = 553
TRAIN_MULTIPLE = 5
COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
MIRROR = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
COUNT_WORDS = {2: "two", 3: "three", 4: "four"}
# plurals that do not take a plain "-s"/"-es"; "skis", "scissors", "broccoli" and "sheep" are their own plural
IRREGULAR_PLURALS = {"person": "people", "knife": "knives", "computer mouse": "computer mice", "sheep": "sheep",
                     "skis": "skis", "scissors": "scissors", "broccoli": "broccoli"}
TEST_TAG_COUNTS = {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100, "color_attr": 100}
TAGS = tuple(TEST_TAG_COUNTS)
PREFIXES = ("a photo of", "an image of", "a picture of")
TEST_FORM = ("a photo of", "a")  # GenEval's wording: the prefix, and "a"/"an" for one object
SPLIT_SIZES = {"train": TRAIN_MULTIPLE * sum(TEST_TAG_COUNTS.values()), "test": sum(TEST_TAG_COUNTS.values())}
DESCRIPTION = "GenEval-format compositional prompts with metadata (six task types, COCO classes, ten colours)"
PROVENANCE = (f"diffrl's seeded generator (seed {SEED}) over GenEval's templates; test split has GenEval's 553-prompt "
              "task counts, train is 5x with no shared prompt text")


def plural(name: str) -> str:
    """The English plural of a COCO class name (``"wine glass"`` → ``"wine glasses"``, ``"person"`` → ``"people"``)."""
    if name in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[name]
    return name + ("es" if name.endswith(("s", "x", "z", "ch", "sh")) else "s")


def _article(word: str) -> str:
    """``"an"`` before a vowel letter, else ``"a"`` (right for every COCO class and colour)."""
    return "an" if word[0] in "aeiou" else "a"


def _phrase(clause: dict, article: str) -> str:
    """One clause as words: ``"three cups"``, ``"a red car"``, ``"one bench"`` (``article``: ``"a"`` or ``"one"``)."""
    if clause["count"] > 1:
        return f"{COUNT_WORDS[clause['count']]} {plural(clause['class'])}"
    words = ([clause["color"]] if "color" in clause else []) + [clause["class"]]
    return " ".join([article if article == "one" else _article(words[0])] + words)


def include_of(tag: str, content: tuple) -> list[dict]:
    """GenEval's ``include`` clauses of one composition (``content``'s layout depends on ``tag``, see :func:`_contents`)."""
    if tag == "single_object":
        return [{"class": content[0], "count": 1}]
    if tag == "colors":
        return [{"class": content[0], "count": 1, "color": content[1]}]
    if tag == "counting":
        return [{"class": content[0], "count": content[1]}]
    if tag == "two_object":
        return [{"class": content[0], "count": 1}, {"class": content[1], "count": 1}]
    if tag == "color_attr":
        return [{"class": c, "count": 1, "color": color} for c, color in content]
    obj, relation, target = content  # position: GenEval lists the target first
    return [{"class": target, "count": 1}, {"class": obj, "count": 1, "position": [relation, 0]}]


def make_row(tag: str, content: tuple, form: tuple[str, str] = TEST_FORM) -> dict:
    """One metadata row ``{"tag", "include", "exclude", "prompt"}``; ``form`` = (prefix, ``"a"`` or ``"one"``)."""
    prefix, article = form
    include = include_of(tag, content)
    if tag == "position":
        text = f"{_phrase(include[1], article)} {include[1]['position'][0]} {_phrase(include[0], article)}"
    else:
        text = " and ".join(_phrase(clause, article) for clause in include)
    exclude = [{"class": content[0], "count": content[1] + 1}] if tag == "counting" else []
    return {"tag": tag, "include": include, "exclude": exclude, "prompt": f"{prefix} {text}"}


def composition_key(tag: str, content: tuple):
    """What makes two rows the same composition: the unordered pair for two_object / color_attr, the position
    read either way ("a dog left of a cat" = "a cat right of a dog"), the content itself otherwise."""
    if tag in ("two_object", "color_attr"):
        return frozenset(content)
    if tag == "position":
        obj, relation, target = content
        return min(content, (target, MIRROR[relation], obj))
    return content


def _contents(tag: str) -> list[tuple] | None:
    """Every composition of a small task type (single_object ``(class,)``, colors ``(class, colour)``, counting
    ``(class, n)``) in a fixed order; None for the large ones, which are drawn by :func:`_draw`."""
    if tag == "single_object":
        return [(c,) for c in COCO_CLASSES]
    if tag == "colors":
        return [(c, color) for c in COCO_CLASSES for color in COLORS]
    if tag == "counting":
        return [(c, n) for c in COCO_CLASSES for n in COUNT_WORDS]
    return None


def _draw(tag: str, rng: random.Random) -> tuple:
    """A random composition of a large task type: two_object ``(a, b)``, color_attr ``((a, colour), (b, colour))``
    with two classes and two colours, position ``(object, relation, target)`` with two classes."""
    a, b = rng.sample(COCO_CLASSES, 2)
    if tag == "two_object":
        return (a, b)
    if tag == "color_attr":
        ca, cb = rng.sample(COLORS, 2)
        return ((a, ca), (b, cb))
    return (a, rng.choice(RELATIONS), b)


def _forms(tag: str) -> list[tuple[str, str]]:
    """The wordings a train row may take: three prefixes × ("a", "one"); counting has no article to vary."""
    return [(p, a) for p in PREFIXES for a in (("a",) if tag == "counting" else ("a", "one"))]


def _test_rows(rng: random.Random) -> list[dict]:
    """GenEval-sized test split: ``TEST_TAG_COUNTS[tag]`` distinct compositions per tag, GenEval's wording."""
    rows = []
    for tag, n in TEST_TAG_COUNTS.items():
        pool = _contents(tag)
        if pool is not None:
            chosen = rng.sample(pool, n)
        else:
            chosen, seen = [], set()
            while len(chosen) < n:
                content = _draw(tag, rng)
                if composition_key(tag, content) not in seen:
                    seen.add(composition_key(tag, content))
                    chosen.append(content)
        rows += [make_row(tag, content) for content in chosen]
    return rows


def _train_rows(rng: random.Random, test: list[dict]) -> list[dict]:
    """Train split: ``TRAIN_MULTIPLE ×`` each tag's test count, held-out compositions first, no test prompt text."""
    test_texts = {row["prompt"] for row in test}
    rows = []
    for tag, n_test in TEST_TAG_COUNTS.items():
        n, forms = TRAIN_MULTIPLE * n_test, _forms(tag)
        test_keys = {composition_key(tag, c) for c in _test_contents(test, tag)}
        pool = _contents(tag)
        picked: list[dict] = []
        if pool is None:  # large spaces: fresh compositions, one wording each
            used = set(test_keys)
            while len(picked) < n:
                content = _draw(tag, rng)
                if composition_key(tag, content) not in used:
                    used.add(composition_key(tag, content))
                    picked.append(make_row(tag, content, rng.choice(forms)))
        else:  # small spaces: every held-out composition once, then again in another wording, then the test's
            held = [c for c in pool if composition_key(tag, c) not in test_keys]
            shared = [c for c in pool if composition_key(tag, c) in test_keys]
            texts = set(test_texts)
            for group in (held, shared):
                rng.shuffle(group)
                order = {c: rng.sample(forms, len(forms)) for c in group}
                for layer in range(len(forms)):
                    for content in group:
                        row = make_row(tag, content, order[content][layer])
                        if row["prompt"] not in texts:
                            texts.add(row["prompt"])
                            picked.append(row)
            if len(picked) < n:
                raise AssertionError(f"geneval train: only {len(picked)} distinct {tag} prompts for {n}")
        rows += picked[:n]
    return rows


def _test_contents(test: list[dict], tag: str) -> list[tuple]:
    """The compositions of the test rows of ``tag`` (inverse of :func:`include_of`)."""
    out = []
    for row in test:
        if row["tag"] != tag:
            continue
        inc = row["include"]
        if tag == "single_object":
            out.append((inc[0]["class"],))
        elif tag in ("colors", "counting"):
            out.append((inc[0]["class"], inc[0]["color"] if tag == "colors" else inc[0]["count"]))
        elif tag == "two_object":
            out.append((inc[0]["class"], inc[1]["class"]))
        elif tag == "color_attr":
            out.append(tuple((c["class"], c["color"]) for c in inc))
        else:
            out.append((inc[1]["class"], inc[1]["position"][0], inc[0]["class"]))
    return out


@functools.lru_cache(maxsize=None)
def build() -> dict[str, tuple[tuple[str, ...], tuple[dict, ...]]]:
    """Both splits, ``{"train"|"test": (prompts, metadata rows)}``, each shuffled with the seed (cached; callers copy)."""
    test = _test_rows(random.Random(SEED))
    train = _train_rows(random.Random(SEED + 1), test)
    out = {}
    for split, rows, seed in (("train", train, SEED + 2), ("test", test, SEED + 3)):
        random.Random(seed).shuffle(rows)
        out[split] = (tuple(row["prompt"] for row in rows), tuple(rows))
    return out
