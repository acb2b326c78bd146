"""``general``: diverse prompts for preference rewards (PickScore, HPS, ImageReward, CLIP), from diffrl's grammar.

A seeded grammar combines subjects (beings, which act, and things, which are in a state), attributes, actions,
settings, art styles, lighting, camera compositions and extra details in ten sentence frames, so prompts do not
all read as one template: subject first, style first, setting first, lighting first, shot type first, two
subjects, a short caption. It stands in for Pick-a-Pic / DrawBench-style prompt lists (human-written there)
and has no metadata. Prompts are distinct; the splits share none.
"""

from __future__ import annotations

import functools
import random

SEED = 2500
SPLIT_SIZES = {"train": 2000, "test": 500}
DESCRIPTION = "diverse general prompts for preference rewards (PickScore, HPS, ImageReward, CLIP); no metadata"
PROVENANCE = f"diffrl's seeded grammar (seed {SEED}): subjects x attributes x actions x settings x styles x lighting, ten frames"

BEINGS = ("fox", "astronaut", "old fisherman", "red panda", "knight", "ballerina", "owl", "robot", "tiger", "child",
          "street musician", "dragon", "jellyfish", "samurai", "grandmother", "hummingbird", "polar bear", "wizard",
          "chef", "deer", "octopus", "cyclist", "monk", "cat", "wolf", "mermaid", "beekeeper", "penguin", "explorer",
          "koala", "painter", "elephant", "scientist", "horse", "firefighter", "raccoon", "skateboarder", "whale",
          "gardener", "lion", "dancer", "hedgehog", "sailor", "parrot", "detective", "otter", "violinist", "golem")
THINGS = ("lighthouse", "vintage car", "treehouse", "teapot", "castle", "sailboat", "greenhouse", "clock tower",
          "hot air balloon", "bicycle", "piano", "cottage", "steam locomotive", "bonsai tree", "cathedral", "bookshelf",
          "windmill", "food truck", "floating island", "pagoda", "typewriter", "bridge", "motorcycle", "chandelier",
          "waterfall", "observatory", "market stall", "spaceship", "mushroom house", "carousel", "lantern", "gramophone",
          "desert temple", "pocket watch", "airship", "library", "bowl of ramen", "birthday cake", "sunflower field")
ATTRIBUTES = ("ancient", "tiny", "giant", "futuristic", "colorful", "weathered", "glowing", "mechanical", "crystal",
              "moss-covered", "golden", "miniature", "elegant", "abandoned", "cheerful", "mysterious", "porcelain",
              "origami", "neon", "rusty", "snow-covered", "translucent", "ornate", "cozy", "majestic", "whimsical",
              "steampunk", "minimalist", "fluffy", "battered", "luminous", "wooden", "paper", "velvet", "gigantic",
              "solitary", "enchanted", "retro", "sleepy", "fierce")
ACTIONS = ("reading a book", "playing the cello", "drinking tea", "looking out over the water", "dancing in the rain",
           "sleeping curled up", "painting a canvas", "flying a kite", "cooking noodles", "watching the stars",
           "running through tall grass", "holding a lantern", "riding a bicycle", "building a sandcastle",
           "writing a letter", "fishing from a pier", "juggling oranges", "meditating", "chasing butterflies",
           "climbing a ladder", "playing chess", "feeding pigeons", "wearing a knitted scarf", "laughing",
           "carrying an umbrella", "planting seeds", "taking a photograph", "singing", "waiting for a train")
STATES = ("half-buried in sand", "covered in ivy", "floating in mid-air", "reflected in a still lake",
          "surrounded by wildflowers", "lit from within", "overgrown with vines", "perched on a cliff", "standing alone",
          "wrapped in fog", "dusted with snow", "crowded with tiny people", "made of glass", "melting slowly",
          "on a checkered floor", "against a pastel wall", "beside a winding river", "in the middle of a storm")
SETTINGS = ("in a misty bamboo forest", "on a rainy Tokyo street", "in a sunflower field", "on the surface of the moon",
            "in a Victorian library", "at a bustling night market", "on a frozen lake", "in a coral reef",
            "on a rooftop garden", "in a desert canyon", "inside a cathedral", "on a quiet country road",
            "in a cyberpunk city", "at the edge of a volcano", "in a snowy pine forest", "on a cliff above the sea",
            "in a sunlit kitchen", "in a cluttered workshop", "on an alien planet", "in an autumn park",
            "in a flooded subway station", "on a tropical beach", "in a candlelit tavern", "above the clouds",
            "in a field of lavender", "at a train platform", "in a tiny apartment", "in the Scottish highlands",
            "on a Venetian canal", "in a glass greenhouse", "under a cherry blossom tree", "in a neon arcade")
STYLES = ("watercolor painting", "oil painting", "35mm film photograph", "pencil sketch", "digital illustration",
          "studio photograph", "ukiyo-e woodblock print", "3D render", "charcoal drawing", "pixel art scene",
          "stained glass window", "claymation still", "gouache illustration", "children's book illustration",
          "art nouveau poster", "isometric illustration", "cinematic still", "linocut print", "pastel drawing",
          "vaporwave artwork", "impressionist painting", "low-poly render", "tilt-shift photograph", "comic book panel",
          "macro photograph", "long-exposure photograph", "paper cut-out artwork", "baroque painting")
LIGHTING = ("soft morning light", "golden hour sunlight", "dramatic rim light", "moonlight", "flickering candlelight",
            "neon glow", "overcast daylight", "harsh midday sun", "warm lamplight", "blue hour twilight",
            "dappled sunlight", "stormy light", "volumetric fog light", "firelight", "aurora light")
SHOTS = ("Close-up", "Wide-angle shot", "Aerial view", "Low-angle shot", "Portrait", "Panoramic view",
         "Overhead shot", "Silhouette", "Macro shot", "Medium shot", "Isometric view", "Fisheye shot")
DETAILS = ("with rain streaking the windows", "with steam rising", "with petals drifting in the air",
           "with long shadows", "with a shallow depth of field", "with intricate details", "with vibrant colors",
           "in muted earth tones", "with a pastel palette", "in black and white", "with sparkling dust in the air",
           "with a cat sleeping nearby", "with birds flying overhead", "with reflections on wet pavement",
           "highly detailed", "in a symmetrical composition", "with soft bokeh", "with bold outlines")


def _a(phrase: str) -> str:
    """``phrase`` with its indefinite article (``"an ancient fox"``, ``"a tiny owl"``)."""
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _cap(text: str) -> str:
    """``text`` with its first letter in upper case."""
    return text[:1].upper() + text[1:]


def _prompt(rng: random.Random) -> str:
    """One prompt: a random subject (being + action or thing + state) in one of ten sentence frames."""
    c = rng.choice
    if rng.random() < 0.55:
        noun, doing = c(BEINGS), c(ACTIONS)
    else:
        noun, doing = c(THINGS), c(STATES)
    subject = _a(f"{c(ATTRIBUTES)} {noun}")
    bare = _a(noun)
    frame = rng.choices(range(10), weights=(5, 3, 2, 2, 2, 2, 1, 2, 1, 2))[0]
    if frame == 0:
        return f"{_cap(subject)} {doing} {c(SETTINGS)}, {c(LIGHTING)}."
    if frame == 1:
        return f"{_cap(subject)} {doing}, {c(STYLES)}, {c(DETAILS)}."
    if frame == 2:
        return f"{_cap(_a(c(STYLES)))} of {subject} {c(SETTINGS)}."
    if frame == 3:
        return f"{_cap(c(SETTINGS))}, {subject} {doing}. {_cap(c(LIGHTING))}, {c(DETAILS)}."
    if frame == 4:
        return f"{c(SHOTS)} of {subject} {doing}, {c(LIGHTING)}, {c(STYLES)}."
    if frame == 5:
        return f"{_cap(c(LIGHTING))} falls on {bare} {doing} {c(SETTINGS)}."
    if frame == 6:
        other = _a(f"{c(ATTRIBUTES)} {c(BEINGS + THINGS)}")
        return f"{_cap(subject)} and {other} {c(SETTINGS)}, {c(STYLES)}."
    if frame == 7:
        first, second = rng.sample(ATTRIBUTES, 2)
        return f"{_cap(noun)} {doing}, {first} and {second}, {c(DETAILS)}."
    if frame == 8:
        return f"What if {bare} were {c(ATTRIBUTES)}? Show it {c(SETTINGS)}, {c(STYLES)}."
    return f"{_cap(c(ATTRIBUTES))} {noun} {c(SETTINGS)}: {c(STYLES)} in {c(LIGHTING)}."


@functools.lru_cache(maxsize=None)
def build() -> dict[str, tuple[tuple[str, ...], None]]:
    """Both splits, ``{"train"|"test": (prompts, None)}``: distinct prompts drawn until both are filled, the first
    ``SPLIT_SIZES["test"]`` for test (cached)."""
    rng = random.Random(SEED)
    total = sum(SPLIT_SIZES.values())
    prompts, seen = [], set()
    while len(prompts) < total:
        prompt = _prompt(rng)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    n_test = SPLIT_SIZES["test"]
    return {"train": (tuple(prompts[n_test:]), None), "test": (tuple(prompts[:n_test]), None)}
