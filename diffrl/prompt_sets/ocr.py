"""``ocr``: text-rendering prompts, a quoted text to render inside a scene, from diffrl's own seeded generator.

A prompt puts one target text in double quotes inside a scene (``A bakery storefront with a sign that reads
"FRESH BREAD DAILY"``); its metadata is ``{"text": <target>}``, exactly the quoted part (what
``rewards.ocr.quoted_text`` extracts). Targets are 1–4 words made from the vocabularies below (short phrases,
business names, numbered labels, names), in upper case or title case. Targets are distinct after OCR's
normalisation (lower case, no whitespace), so no target appears twice, and the test and train splits share
no target text (hence no prompt). It stands in for Flow-GRPO's OCR prompt set (LLM-written scenes, ~20k
train / ~1k test); see ``docs/prompts.md`` for how it differs.
"""

from __future__ import annotations

import functools
import random

SEED = 1017
SPLIT_SIZES = {"train": 5000, "test": 1000}
DESCRIPTION = "text-rendering prompts: a quoted 1-4 word text inside a scene, metadata {'text': target}"
PROVENANCE = (f"diffrl's seeded generator (seed {SEED}): scene templates x project-written vocabulary; "
              "splits disjoint by target text")

ADJECTIVES = ("fresh", "hot", "cold", "free", "new", "homemade", "happy", "lucky", "golden", "silver", "wild", "tiny",
              "grand", "secret", "daily", "local", "organic", "vintage", "classic", "sweet", "spicy", "cosy", "famous",
              "little", "big", "warm", "green", "blue", "red", "honest", "simple", "modern", "royal", "urban", "rustic",
              "crispy", "best", "handmade", "original", "midnight")
NOUNS = ("bread", "coffee", "pizza", "books", "tea", "flowers", "music", "donuts", "tacos", "noodles", "pies", "juice",
         "cakes", "bagels", "soup", "waffles", "burgers", "records", "plants", "bikes", "tools", "toys", "maps", "shoes",
         "hats", "candles", "honey", "cheese", "pasta", "sushi", "dumplings", "lemonade", "cookies", "pretzels", "ideas",
         "dreams", "stories", "games", "movies", "comics", "art", "jazz", "parking", "rooms", "tickets", "snacks",
         "pancakes", "muffins", "ramen", "salads", "smoothies", "gelato", "vinyl", "postcards", "crafts", "antiques")
VERBS = ("try", "taste", "enjoy", "find", "love", "share", "grab", "order", "buy", "get", "discover", "explore",
         "choose", "savor", "collect", "gift")
PLACES = ("cafe", "bakery", "diner", "garage", "studio", "market", "books", "bistro", "tavern", "pharmacy", "salon",
          "gallery", "theater", "motel", "barbershop", "grocery", "kitchen", "workshop", "library", "florist",
          "pizzeria", "bar", "hardware", "laundry", "records", "deli", "cinema", "bookshop", "inn", "farm")
NAMES = ("luna", "oscar", "mia", "leo", "nora", "felix", "ivy", "hugo", "ada", "milo", "rosa", "theo", "ella", "jack",
         "zoe", "sam", "maya", "otto", "clara", "eli", "greta", "omar", "lena", "rafael", "sofia", "ben", "iris",
         "max", "nina", "paolo", "ruby", "tariq", "vera", "yuki", "amara", "diego", "hana", "kofi", "lucia", "marco")
NUMBERED = ("room", "gate", "exit", "platform", "route", "aisle", "table", "locker", "suite", "bay", "track", "bus",
            "floor", "lane", "pier", "booth", "studio", "unit", "dock", "row")
SINGLE = ("open", "closed", "welcome", "exit", "stop", "sale", "push", "pull", "quiet", "danger", "entrance", "menu",
          "hello", "goodbye", "cheers", "bakery", "coffee", "tickets", "parking", "information", "library",
          "pharmacy", "hotel", "taxi", "police", "museum", "station", "garden", "cinema", "arcade")
TAILS = ("daily", "today", "inside", "here", "now", "tonight", "ahead", "nearby")
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")

SURFACES = (
    "a wooden sign that reads", "a neon sign that says", "a coffee mug printed with the words", "a chalkboard that says",
    "a white t-shirt printed with", "a birthday cake with icing that spells", "a paperback book titled",
    "a movie poster with the title", "a street banner that reads", "a handwritten note that says",
    "a graffiti mural spelling out", "a shop window with a decal reading", "an embroidered pillow that says",
    "a rusty metal sign stamped with", "a billboard that reads", "a vintage postcard that reads",
    "a glowing LED display showing", "a tote bag printed with", "a brass plaque engraved with",
    "a sandwich board that says", "a train station sign that reads", "a hand-painted van with the words",
    "a paper lantern painted with", "a cereal box labelled", "a greeting card that says", "a flag embroidered with",
    "a road sign that reads", "a sticky note that says", "a jar with a label reading", "a baseball cap embroidered with",
    "a stone wall carved with the words", "a cardboard box stamped with", "a laptop screen showing the words",
    "a hanging shop sign that reads", "a wine bottle with a label reading", "a concert ticket printed with",
)
SCENES = (  # whole scenes: no setting is added to them
    "a bakery storefront with a sign that reads", "a food truck with a menu board that says",
    "a hotel lobby with a brass sign that reads", "a bookstore window with a poster that reads",
    "a subway platform with a poster that says", "a city bus with a destination display showing",
    "a boxing gym with a banner that reads", "a red barn with a painted sign that reads",
)
SETTINGS = (
    "on a rainy city street at night", "in a sunlit kitchen", "on a quiet village street at dusk",
    "in a busy train station", "on a sandy beach at sunset", "in a cosy cafe", "at a crowded farmers market",
    "in a snowy mountain town", "on a desk beside a cup of tea", "in a dim jazz bar", "on a foggy harbour pier",
    "in a bright art studio", "at the edge of a pine forest", "in a neon-lit alley", "on a wooden table",
    "in a flower-filled courtyard", "at a roadside diner in the desert", "inside a busy shopping mall",
    "on a brick wall downtown", "in a child's bedroom", "at a summer music festival", "in an old library",
    "on a school bulletin board", "beside a canal in autumn", "in a futuristic space station",
)
TIMES = ("at dusk", "at night", "on a sunny morning", "in the rain", "in the snow", "on a busy afternoon")
STYLES = ("A photo of", "A close-up photograph of", "A watercolor illustration of", "A 3D render of", "A cinematic shot of",
          "A vintage film photo of", "A flat vector illustration of", "A product photo of")


def _words(rng: random.Random) -> list[str]:
    """One target text's words (lower case), 1–4 of them, from one of the text patterns."""
    pattern = rng.choices(range(9), weights=(2, 6, 3, 3, 5, 4, 3, 3, 3))[0]
    c = rng.choice
    if pattern == 0:
        return [c(SINGLE)]
    if pattern == 1:
        return [c(ADJECTIVES), c(NOUNS)]
    if pattern == 2:
        return [f"{c(NAMES)}'s", c(PLACES)]
    if pattern == 3:
        return [c(NUMBERED), str(rng.randint(1, 999))]
    if pattern == 4:
        return [c(VERBS), c(ADJECTIVES), c(NOUNS)]
    if pattern == 5:
        return [c(ADJECTIVES), c(NOUNS), c(TAILS)]
    if pattern == 6:
        return [f"{c(NAMES)}'s", c(ADJECTIVES), c(PLACES)]
    if pattern == 7:
        return [c(VERBS), "the", c(ADJECTIVES), c(NOUNS)]
    return rng.choice(([c(("open", "closed")), "until", str(rng.randint(1, 12)), c(("am", "pm"))],
                       ["since", str(rng.randint(1890, 2024))], ["see", "you", c(DAYS)], [c(NOUNS), "from", f"${rng.randint(2, 99)}"]))


def _cased(words: list[str], rng: random.Random) -> str:
    """The words joined in upper case (``FRESH BREAD``) or title case (``Fresh Bread``, ``Mia's Bistro``)."""
    if rng.random() < 0.55:
        return " ".join(w.upper() for w in words)
    return " ".join(w[:1].upper() + w[1:] for w in words)


def normalised(text: str) -> str:
    """The OCR reward's comparison form: lower case, whitespace removed."""
    return "".join(text.lower().split())


def _scene(text: str, rng: random.Random) -> str:
    """A prompt placing the quoted ``text`` in a scene: a surface in one of four sentence frames (with a setting,
    with a style and a setting, setting first, or alone), or a whole scene with a time of day (and maybe a style)."""
    surface, setting, frame = rng.choice(SURFACES + SCENES), rng.choice(SETTINGS), rng.randrange(4)
    quoted = f'{surface} "{text}"'
    if surface in SCENES:
        time = rng.choice(TIMES)
        return f"{rng.choice(STYLES)} {quoted} {time}." if frame < 2 else f"{quoted[0].upper()}{quoted[1:]} {time}."
    if frame == 0:
        return f"{quoted[0].upper()}{quoted[1:]} {setting}."
    if frame == 1:
        return f"{rng.choice(STYLES)} {quoted}, {setting}."
    if frame == 2:
        return f"{setting[0].upper()}{setting[1:]}, {quoted}."
    return f"{quoted[0].upper()}{quoted[1:]}."


@functools.lru_cache(maxsize=None)
def build() -> dict[str, tuple[tuple[str, ...], tuple[dict, ...]]]:
    """Both splits, ``{"train"|"test": (prompts, ({"text": target}, …))}`` (cached; callers copy).

    Distinct targets (by :func:`normalised`) are drawn until both splits are filled and shuffled; the first
    ``SPLIT_SIZES["test"]`` go to the test split, the rest to train; each gets its own scene."""
    rng = random.Random(SEED)
    total = sum(SPLIT_SIZES.values())
    texts, seen = [], set()
    while len(texts) < total:
        text = _cased(_words(rng), rng)
        if normalised(text) not in seen:
            seen.add(normalised(text))
            texts.append(text)
    rng.shuffle(texts)  # the rarer short patterns run out first: shuffle so both splits have the same mix
    out = {}
    for split, chunk in (("test", texts[: SPLIT_SIZES["test"]]), ("train", texts[SPLIT_SIZES["test"]:])):
        prompts = tuple(_scene(text, rng) for text in chunk)
        out[split] = (prompts, tuple({"text": text} for text in chunk))
    return {"train": out["train"], "test": out["test"]}
