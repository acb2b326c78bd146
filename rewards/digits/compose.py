"""The digits-compose world (GenEval at miniature scale): 1–4 coloured digits on a 32×32 canvas, the prompt
grammar over GenEval's six task types, and the cheap training reward ``digits_compose``.

**Canvas.** ``[3, 32, 32]`` in [0, 1], black background, a 2×2 layout of 16×16 slots (row-major: 0 top-left,
1 top-right, 2 bottom-left, 3 bottom-right). A digit is an sklearn 8×8 digit upsampled to 12×12
(:func:`load_digits_12`), coloured with the digits palette and placed in the middle of its slot (2-pixel
margin), so digits in neighbouring slots are ≥ 4 pixels apart.

**Prompts** (:func:`make_prompt`, parsed back to GenEval's metadata rows by :func:`parse`, task type by :func:`tag`):

=============  ==============================  ===========================================================
task type      form                            rule (GenEval's, see ``rewards.digits.compose_judge``)
=============  ==============================  ===========================================================
single_object  ``a seven``                     ≥ 1 seven
colors         ``a green four``                ≥ 1 four, the first one green
two_object     ``a two and a five``            ≥ 1 two and ≥ 1 five (colours free)
counting       ``three sevens``                exactly 3 sevens (2–4; other digits allowed)
color_attr     ``a red two and a blue five``   a red two and a blue five (digits and colours differ)
position       ``a four left of a one``        a four and a one, the four's centre left of the one's
=============  ==============================  ===========================================================

Relations: ``left of``, ``right of``, ``above``, ``below``. As in GenEval, position prompts name no colour.
The built-in prompt set (:func:`default_prompts`, 10 per type, seeded) is held out of pretraining.

**Training reward** ``digits_compose`` (not the judge; see :class:`DigitsComposeReward`): the digits reward
classifier (``assets/digits/reward_classifier``) applied to each slot's middle 12×12 (upsampled to its
16×16 input), an occupancy term from the slot's brightness, and soft clause scores (or, with ``rule="probability"``,
the probability that GenEval's rule holds under that reading); it assumes the 2×2 layout and knows nothing of
connected components, so it has blind spots the judge does not share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rewards.base import Reward, register_reward
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.data import ASSET_DIR, COLOUR_NAMES, DIGIT_WORDS, colourise

COMPOSE_ASSET_DIR = ASSET_DIR.parent / "digits_compose"
CANVAS = 32
SLOT = 16
DIGIT_SIZE = 12
MARGIN = (SLOT - DIGIT_SIZE) // 2
SLOTS = [(0, 0), (0, 1), (1, 0), (1, 1)]
"""(row, column) of each slot"""
TASKS = ("single_object", "two_object", "counting", "colors", "color_attr", "position")
HARD_TASKS = ("counting", "color_attr", "position")
RELATIONS = ("left of", "right of", "above", "below")
PLURALS = ["zeros", "ones", "twos", "threes", "fours", "fives", "sixes", "sevens", "eights", "nines"]
COUNT_WORDS = {"two": 2, "three": 3, "four": 4}
WORDS = ["a", "an", "and", "left", "right", "of", "above", "below", *COLOUR_NAMES, *DIGIT_WORDS, *PLURALS]
"""every word of every prompt (the text encoder's vocabulary after its padding token; count words are digit words)"""
MAX_WORDS = 7
"""words of the longest prompt (``a red two and a blue five``)"""
PROMPTS_PER_TASK = 10
PROMPTS_SEED = 20


def article(digit: int) -> str:
    """``"an"`` before ``eight``, else ``"a"`` (``a one``)."""
    return "an" if DIGIT_WORDS[digit] == "eight" else "a"


def _noun(digit: int, colour: int | None = None) -> str:
    return " ".join([article(digit) if colour is None else "a", *([COLOUR_NAMES[colour]] if colour is not None else []), DIGIT_WORDS[digit]])


def make_prompt(meta: dict) -> str:
    """GenEval metadata (as :func:`parse` returns) → the prompt; inverse of :func:`parse`."""
    tag, inc = meta["tag"], meta["include"]
    cls = [DIGIT_WORDS.index(c["class"]) for c in inc]
    col = [COLOUR_NAMES.index(c["color"]) if "color" in c else None for c in inc]
    if tag in ("single_object", "colors"):
        return _noun(cls[0], col[0])
    if tag == "counting":
        return f"{[w for w, n in COUNT_WORDS.items() if n == inc[0]['count']][0]} {PLURALS[cls[0]]}"
    if tag in ("two_object", "color_attr"):
        return f"{_noun(cls[0], col[0])} and {_noun(cls[1], col[1])}"
    return f"{_noun(cls[1])} {inc[1]['position'][0]} {_noun(cls[0])}"  # position: the target clause is first


def _bad(prompt: str) -> ValueError:
    return ValueError(
        f"digits-compose prompt {prompt!r} is none of 'a seven', 'a green four', 'a two and a five', 'three sevens', "
        f"'a red two and a blue five', 'a four left of a one' (colours {COLOUR_NAMES}, counts two–four, relations {list(RELATIONS)})"
    )


def _phrase(words: list[str], prompt: str) -> dict:
    """``[a(n), (colour), digit]`` → an include clause ``{"class", "count": 1, "color"?}``."""
    if len(words) not in (2, 3) or words[-1] not in DIGIT_WORDS:
        raise _bad(prompt)
    digit = DIGIT_WORDS.index(words[-1])
    if len(words) == 3:
        if words[0] != "a" or words[1] not in COLOUR_NAMES:
            raise _bad(prompt)
        return {"class": words[-1], "count": 1, "color": words[1]}
    if words[0] != article(digit):
        raise _bad(prompt)
    return {"class": words[-1], "count": 1}


def parse(prompt: str) -> dict:
    """The prompt's GenEval metadata row ``{"tag", "include": [clauses], "exclude": [clauses]}``
    (clauses ``{"class": digit word, "count", "color"?, "position"?: [relation, target index]}``), the form
    ``rewards.geneval.check`` reads. Raises a one-line ``ValueError`` naming the prompt for anything else."""
    words = prompt.strip().lower().split()
    text = " ".join(words)
    for rel in RELATIONS:
        left, sep, right = text.partition(f" {rel} ")
        if sep:
            obj, target = _phrase(left.split(), prompt), _phrase(right.split(), prompt)
            if "color" in obj or "color" in target or obj["class"] == target["class"]:
                raise _bad(prompt)
            return {"tag": "position", "include": [target, {**obj, "position": [rel, 0]}], "exclude": []}
    if "and" in words:
        i = words.index("and")
        a, b = _phrase(words[:i], prompt), _phrase(words[i + 1:], prompt)
        if a["class"] == b["class"] or ("color" in a) != ("color" in b) or ("color" in a and a["color"] == b["color"]):
            raise _bad(prompt)
        return {"tag": "color_attr" if "color" in a else "two_object", "include": [a, b], "exclude": []}
    if len(words) == 2 and words[0] in COUNT_WORDS and words[1] in PLURALS:
        n, cls = COUNT_WORDS[words[0]], DIGIT_WORDS[PLURALS.index(words[1])]
        return {"tag": "counting", "include": [{"class": cls, "count": n}], "exclude": [{"class": cls, "count": n + 1}]}
    clause = _phrase(words, prompt)
    return {"tag": "colors" if "color" in clause else "single_object", "include": [clause], "exclude": []}


def tag(prompt: str) -> str:
    """The prompt's task type (one of :data:`TASKS`)."""
    return parse(prompt)["tag"]


def random_meta(task: str, g: torch.Generator) -> dict:
    """A uniformly random metadata row of task type ``task``."""
    def rand(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    def two_distinct(n: int) -> tuple[int, int]:
        a = rand(n)
        return a, (a + 1 + rand(n - 1)) % n

    d1, d2 = two_distinct(10)
    c1, c2 = two_distinct(len(COLOUR_NAMES))
    w1, w2 = DIGIT_WORDS[d1], DIGIT_WORDS[d2]
    if task == "single_object":
        return {"tag": task, "include": [{"class": w1, "count": 1}], "exclude": []}
    if task == "colors":
        return {"tag": task, "include": [{"class": w1, "count": 1, "color": COLOUR_NAMES[c1]}], "exclude": []}
    if task == "counting":
        n = 2 + rand(3)
        return {"tag": task, "include": [{"class": w1, "count": n}], "exclude": [{"class": w1, "count": n + 1}]}
    if task == "two_object":
        return {"tag": task, "include": [{"class": w1, "count": 1}, {"class": w2, "count": 1}], "exclude": []}
    if task == "color_attr":
        return {"tag": task, "include": [{"class": w1, "count": 1, "color": COLOUR_NAMES[c1]}, {"class": w2, "count": 1, "color": COLOUR_NAMES[c2]}], "exclude": []}
    if task == "position":
        return {"tag": task, "include": [{"class": w2, "count": 1}, {"class": w1, "count": 1, "position": [RELATIONS[rand(4)], 0]}], "exclude": []}
    raise ValueError(f"unknown digits-compose task type {task!r}; choose one of {TASKS}")


def default_prompts(per_task: int = PROMPTS_PER_TASK, seed: int = PROMPTS_SEED) -> list[str]:
    """The built-in (held-out) prompt set: ``per_task`` distinct seeded prompts of each task type, task-major."""
    g = torch.Generator().manual_seed(seed)
    out: list[str] = []
    for task in TASKS:
        chosen: list[str] = []
        while len(chosen) < per_task:
            p = make_prompt(random_meta(task, g))
            if p not in chosen:
                chosen.append(p)
        out.extend(chosen)
    return out


# -- canvases ----------------------------------------------------------------------------------------------
def load_digits_12() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's digits as ``[N, 1, 12, 12]`` intensities in [0, 1] (bilinear from 8×8) and labels ``[N]``."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(DIGIT_SIZE, DIGIT_SIZE), mode="bilinear", align_corners=False)
    return x.clamp(0, 1), torch.tensor(bunch.target, dtype=torch.long)


def layout(meta: dict, g: torch.Generator) -> list[tuple[int, int, int]]:
    """Objects ``(slot, digit, colour)`` that satisfy ``meta`` (random slots; random colours where none is asked)."""
    def rand(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    inc = meta["include"]
    digits = [DIGIT_WORDS.index(c["class"]) for c in inc for _ in range(c["count"])]
    colours = [COLOUR_NAMES.index(c["color"]) if "color" in c else rand(len(COLOUR_NAMES)) for c in inc for _ in range(c["count"])]
    if meta["tag"] == "position":  # digits[0] is the target, digits[1] the object placed `rel` of it
        rel = inc[1]["position"][0]
        pairs = [(a, b) for a in range(4) for b in range(4) if a != b and slot_relation(b, a, rel)]
        slots = list(pairs[rand(len(pairs))])
    else:
        slots = torch.randperm(4, generator=g)[: len(digits)].tolist()
    return list(zip(slots, digits, colours))


def slot_relation(a: int, b: int, rel: str) -> bool:
    """Whether slot ``a`` is ``rel`` of slot ``b`` in the 2×2 layout (a diagonal pair is both, as GenEval's rule reads it)."""
    (ra, ca), (rb, cb) = SLOTS[a], SLOTS[b]
    return {"left of": ca < cb, "right of": ca > cb, "above": ra < rb, "below": ra > rb}[rel]


def render(objects: list[tuple[int, int, int]], intensities: list[torch.Tensor]) -> torch.Tensor:
    """A float canvas ``[3, 32, 32]`` in [0, 1] with each ``(slot, digit, colour)`` drawn from the matching
    intensity ``[1, 12, 12]`` in ``intensities`` (same order)."""
    canvas = torch.zeros(3, CANVAS, CANVAS)
    for (slot, _, colour), x in zip(objects, intensities):
        r, c = SLOTS[slot]
        y0, x0 = r * SLOT + MARGIN, c * SLOT + MARGIN
        canvas[:, y0 : y0 + DIGIT_SIZE, x0 : x0 + DIGIT_SIZE] = colourise(x[None], torch.tensor([colour]))[0]
    return canvas


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    return (images.clamp(0, 1) * 255.0).round().to(torch.uint8)


# -- the training reward ------------------------------------------------------------------------------------
def slot_crops(images: torch.Tensor) -> torch.Tensor:
    """``images [B, 3, 32, 32]`` in [0, 1] → ``[B, 4, 3, 16, 16]``: each slot's middle 12×12, upsampled to the
    digits classifiers' 16×16 input."""
    crops = [images[:, :, r * SLOT + MARGIN : r * SLOT + MARGIN + DIGIT_SIZE, c * SLOT + MARGIN : c * SLOT + MARGIN + DIGIT_SIZE] for r, c in SLOTS]
    x = F.interpolate(torch.stack(crops, 1).flatten(0, 1), size=(16, 16), mode="bilinear", align_corners=False)
    return x.view(images.shape[0], 4, 3, 16, 16)


def slot_scores(clause: dict, occupancy: torch.Tensor, p_digit: torch.Tensor, p_colour: torch.Tensor) -> torch.Tensor:
    """``[4]``: each slot's probability of holding ``clause``'s object, ``occupancy · p(class) · p(colour)``
    (the colour factor only where the clause asks for one)."""
    s = occupancy * p_digit[:, DIGIT_WORDS.index(clause["class"])]
    return s * p_colour[:, COLOUR_NAMES.index(clause["color"])] if "color" in clause else s


def soft_clauses(meta: dict, occupancy: torch.Tensor, p_digit: torch.Tensor, p_colour: torch.Tensor) -> torch.Tensor:
    """Rule ``"soft"``: mean soft truth of ``meta``'s clauses from per-slot ``occupancy [4]``, ``p_digit [4, 10]`` and
    ``p_colour [4, 6]``: a clause's expected count ``m = Σ_slots`` :func:`slot_scores` scores
    ``min(m / count, 1)`` (``1 − min(|m − count|, 1)`` for counting); a position clause scores
    ``max`` over slot pairs in the relation of the product of the two objects' slot scores. Partial credit per
    clause; four ambiguous sevens (each 0.75) satisfy "three sevens" fully."""
    scores = []
    per_slot = []
    for clause in meta["include"]:
        s = slot_scores(clause, occupancy, p_digit, p_colour)
        per_slot.append(s)
        m, n = s.sum(), clause["count"]
        if "position" in clause:
            rel, target = clause["position"]
            t = per_slot[target]
            scores.append(torch.stack([s[a] * t[b] for a in range(4) for b in range(4) if a != b and slot_relation(a, b, rel)]).max())
        elif meta["tag"] == "counting":
            scores.append(1.0 - (m - n).abs().clamp(max=1.0))
        else:
            scores.append((m / n).clamp(max=1.0))
    return torch.stack(scores).mean()


def exact_count(s: torch.Tensor, n: int) -> torch.Tensor:
    """P(exactly ``n`` of independent events with probabilities ``s [K]`` happen) (Poisson binomial, by recursion)."""
    dist = torch.zeros(len(s) + 1, dtype=s.dtype)
    dist[0] = 1.0
    for p in s:
        dist = torch.cat([dist[:1] * (1 - p), dist[1:] * (1 - p) + dist[:-1] * p])
    return dist[n]


_STATES = torch.cartesian_prod(*[torch.arange(3)] * 4)
"""``[81, 4]``: every assignment of the four slots to {0: neither object, 1: the first clause's, 2: the second's}"""


def probability_clauses(meta: dict, occupancy: torch.Tensor, p_digit: torch.Tensor, p_colour: torch.Tensor) -> torch.Tensor:
    """Rule ``"probability"``: the probability that GenEval's rule holds for ``meta`` *whichever object of a class
    the detector ranks first*, if each slot independently held clause ``k``'s object in the asked colour with
    probability ``s_k`` (:func:`slot_scores`) or in another colour with ``v_k = occupancy · p(class) · (1 − p(colour))``
    (0 for colour-free clauses). The clauses name different digits, so a slot holds at most one of them.

    * one clause: ≥ 1 object in the asked colour and none in another, ``Q(v) − Q(v + s)`` with
      ``Q(x) = Π_slots (1 − x)`` (the probability that no slot holds an ``x`` object); counting: exactly ``count``
      objects of the class (Poisson binomial), colours free;
    * two clauses: both present, no wrong colours, by inclusion–exclusion ``Σ_{S ⊆ {1, 2}} (−1)^{|S|} Q(v₁ + v₂ + Σ_S s)``;
    * position: the sum over the 81 slot assignments in which both digits are present and every object of the
      second clause stands ``rel`` of every object of the first (the target).

    No partial credit and no credit for hedging: four ambiguous sevens (each 0.75) are three sevens with
    probability 4 · 0.75³ · 0.25 ≈ 0.42; a green four next to a red four is not "a green four" (GenEval reads the
    most confident four's colour); fours on both sides of a one are not "a four left of a one"."""
    clauses = meta["include"]
    s = [slot_scores(c, occupancy, p_digit, p_colour) for c in clauses]
    v = [occupancy * p_digit[:, DIGIT_WORDS.index(c["class"])] - sk if "color" in c else torch.zeros_like(sk) for c, sk in zip(clauses, s)]

    def none_of(x: torch.Tensor) -> torch.Tensor:
        return (1 - x).clamp(min=0).prod()

    if meta["tag"] == "counting":
        return exact_count(s[0], clauses[0]["count"])
    if meta["tag"] != "position":
        wrong = sum(v)
        subsets = [[]] + [[k] for k in range(len(s))] + ([[0, 1]] if len(s) == 2 else [])
        return sum((-1) ** len(sub) * none_of(wrong + sum((s[k] for k in sub), torch.zeros_like(wrong))) for sub in subsets)
    rel = clauses[1]["position"][0]
    q = torch.stack([(1 - s[0] - s[1]).clamp(min=0), s[0], s[1]], 1)  # [4 slots, 3 states]
    p_state = q.gather(1, _STATES.T).prod(0)  # [81]
    return p_state[_POSITION_OK[rel]].sum()


def _position_ok(rel: str) -> torch.Tensor:
    """``[81]`` bool over :data:`_STATES`: a target (1) and an object (2) present, every object ``rel`` of every target."""
    out = []
    for x in _STATES.tolist():
        objs, targets = [i for i in range(4) if x[i] == 2], [j for j in range(4) if x[j] == 1]
        out.append(bool(objs and targets) and all(slot_relation(i, j, rel) for i in objs for j in targets))
    return torch.tensor(out)


_POSITION_OK = {rel: _position_ok(rel) for rel in RELATIONS}
""":func:`_position_ok` of each relation, computed once (the reward reads it for every position prompt)"""


def _exact_ok(n1: int, n2: int, rel: str | None) -> torch.Tensor:
    """``[81]`` bool over :data:`_STATES` read as {0: empty, 1: the first clause's object, 2: the second's}: exactly ``n1``
    and ``n2`` of them, and with ``rel`` the second's object ``rel`` of the first (the target; :data:`_POSITION_OK`)."""
    ok = ((_STATES == 1).sum(1) == n1) & ((_STATES == 2).sum(1) == n2)
    return ok & _POSITION_OK[rel] if rel is not None else ok


_EXACT_OK: dict[tuple[int, int, str | None], torch.Tensor] = {}
""":func:`_exact_ok` of each (count, count, relation) a prompt asks for, computed on first use"""


def exact_clauses(meta: dict, occupancy: torch.Tensor, p_digit: torch.Tensor, p_colour: torch.Tensor) -> torch.Tensor:
    """Rule ``"exact"``: the probability that the canvas holds **exactly** what the prompt names (the named digits in
    the named number and colours, in the named relation, and nothing else), if each slot independently were empty
    with probability ``1 − occupancy``, held clause ``k``'s object with ``s_k`` (:func:`slot_scores`), or held
    anything else (another digit, a wrong colour, a blob) with the rest:
    ``Σ`` over the 81 assignments of the slots to {empty, clause 1, clause 2} with the asked counts (and relation) of
    ``Π_slots q(slot, state)``. An extra copy, an unnamed digit or a hedged slot costs its probability: four
    certain sevens are "a seven" with probability 0, one certain seven in an otherwise empty canvas with 1. GenEval's
    rule (``≥ count``) holds whenever this one does."""
    clauses = meta["include"]
    s = [slot_scores(c, occupancy, p_digit, p_colour) for c in clauses]
    n1, n2 = clauses[0]["count"], (clauses[1]["count"] if len(clauses) > 1 else 0)
    rel = clauses[1]["position"][0] if meta["tag"] == "position" else None
    key = (n1, n2, rel)
    if key not in _EXACT_OK:
        _EXACT_OK[key] = _exact_ok(*key)
    q = torch.stack([(1 - occupancy).clamp(min=0), s[0], s[1] if len(s) > 1 else torch.zeros_like(s[0])], 1)  # [4 slots, 3 states]
    return q.gather(1, _STATES.T).prod(0)[_EXACT_OK[key]].sum()


RULES = {"soft": soft_clauses, "probability": probability_clauses, "exact": exact_clauses}


@register_reward("digits_compose")
class DigitsComposeReward(Reward):
    """Cheap training reward in [0, 1] from the 2×2 slots read by the digits reward classifier (digit and colour
    per slot) and a brightness occupancy ``sigmoid((mean max-channel − 0.08) / 0.02)``, combined by ``rule``.

    Args:
        path: folder of the classifier (default: the shipped ``assets/digits/reward_classifier``).
        device: where the classifier runs.
        rule: ``"soft"`` (:func:`soft_clauses`, mean partial credit per clause; the default), ``"probability"``
            (:func:`probability_clauses`, the chance that the prompt holds under the classifier's reading,
            whichever object of a class comes first) or ``"exact"`` (:func:`exact_clauses`, the chance that the canvas
            holds exactly the named objects and nothing else: no credit for extra copies).
    """

    unit = "probability (or soft fraction) of the prompt holding, in [0, 1]"
    scale = (0.0, 1.0)

    def __init__(self, path: str | None = None, device: str = "cpu", rule: str = "soft"):
        if rule not in RULES:
            raise ValueError(f"digits_compose rule {rule!r} is unknown; set +reward.options.digits_compose.rule to one of {sorted(RULES)}")
        self.device = device
        self.rule = RULES[rule]
        self.model = DigitsClassifier.from_pretrained(path or ASSET_DIR / "reward_classifier").to(device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, CANVAS, CANVAS):
            raise ValueError(f"reward {self.name!r} reads images [B, 3, {CANVAS}, {CANVAS}], got {tuple(images.shape)}")
        metas = [parse(p) for p in prompts]
        crops = slot_crops(images.to(self.device).float() / 255.0)
        d_logits, c_logits = self.model(crops.flatten(0, 1))
        b = images.shape[0]
        p_digit, p_colour = d_logits.softmax(-1).view(b, 4, -1).cpu(), c_logits.softmax(-1).view(b, 4, -1).cpu()
        occupancy = torch.sigmoid((crops.amax(2).mean((2, 3)).cpu() - 0.08) / 0.02)
        return {self.name: torch.stack([self.rule(m, occupancy[i], p_digit[i], p_colour[i]) for i, m in enumerate(metas)]).clamp(0, 1)}
