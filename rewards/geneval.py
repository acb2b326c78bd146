"""``geneval``: a GenEval-style compositional reward for real images on an open-vocabulary detector (OWLv2).

GenEval (Ghosh et al. 2023) checks an image against a prompt's structure: which objects, how many, which
colour, where. Its evaluation detects COCO objects with Mask2Former (mmdetection) and classifies colours with
CLIP. This reward keeps GenEval's metadata and its rules and detects with transformers'
``Owlv2ForObjectDetection``, which takes the object names as text queries, so any noun works:

* **metadata** (GenEval's ``evaluation_metadata.jsonl`` rows): ``{"tag", "include": [{"class", "count",
  "color"?, "position"?: [relation, target_index]}], "exclude": [{"class", "count"}]}``. Pass rows per sample
  as ``metadata`` (a list of dicts), or let :func:`parse_prompt` derive them from GenEval-style prompts
  ("a photo of three cups", "a photo of a red car and a blue bench", "a photo of a dog right of a cat");
* **detection**: one query per class, ``"a photo of a {class}"``. Boxes whose sigmoid score passes ``threshold``
  (``counting_threshold`` for counting prompts) are kept per class, most confident first, at most
  ``max_objects``, with greedy NMS at ``nms_iou`` (1.0 keeps every box, as GenEval's default);
* **colour** of a found object: the argmax over GenEval's ten colours of OWLv2's logits for that box against
  ``"a photo of a {colour} {class}"`` queries (GenEval crops the box and asks CLIP; OWLv2's per-box class
  embeddings play that part here);
* **rules** (:func:`check`, GenEval's ``evaluate``): an ``include`` clause holds when its class has at least
  ``count`` objects, the first ``count`` of them have the colour if one is asked, and each of them stands in
  the relation to every object of its target clause (:func:`relative_position`, GenEval's margin of 0.1 of the
  two boxes' sizes). An ``exclude`` clause holds when its class has fewer than ``count`` objects.

Outputs: ``geneval`` = the fraction of clauses that hold (partial credit, a denser training signal: diffrl's
choice) and ``geneval_strict`` ∈ {0, 1}, GenEval's own per-image correctness (all clauses hold).

Weights: ``checkpoint=`` an OWLv2 ``Owlv2ForObjectDetection`` folder with its processor, a local path or a Hub id
(default ``google/owlv2-base-patch16-ensemble`` through the Hugging Face cache); ``random_init=True`` builds random weights (tests; with
``model_config`` a tiny architecture). The thresholds are GenEval's Mask2Former values by default; OWLv2's
scores are calibrated differently, so set them for the checkpoint used (its model card suggests ≈ 0.1–0.3).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from rewards.base import Reward, RewardError, Weights, register_reward
from rewards.clip_models import _dtype, openai_clip_tokenizer

COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
RELATIONS = ["left of", "right of", "above", "below"]
NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
POSITION_THRESHOLD = 0.1
# plurals that the suffix rules below get wrong (COCO's and common nouns)
IRREGULAR = {"people": "person", "mice": "mouse", "knives": "knife", "sheep": "sheep", "skis": "skis", "scissors": "scissors",
             "giraffes": "giraffe", "wine glasses": "wine glass", "benches": "bench", "sandwiches": "sandwich", "couches": "couch",
             "buses": "bus", "toothbrushes": "toothbrush", "boxes": "box", "children": "child", "men": "man", "women": "woman",
             "teeth": "tooth", "feet": "foot", "geese": "goose", "leaves": "leaf", "wolves": "wolf", "shelves": "shelf",
             "horses": "horse", "suitcases": "suitcase", "vases": "vase", "houses": "house", "nurses": "nurse", "purses": "purse"}


def singular(noun: str) -> str:
    """A plural noun phrase's singular: the irregular table, then ``-ies → -y``, ``-(s|x|z|ch|sh)es → -\\1``, ``-s → ''``."""
    if noun in IRREGULAR:
        return IRREGULAR[noun]
    head, _, last = noun.rpartition(" ")
    prefix = f"{head} " if head else ""
    if last in IRREGULAR:
        return prefix + IRREGULAR[last]
    if last.endswith("ies") and len(last) > 4:
        return prefix + last[:-3] + "y"
    if re.search(r"(s|x|z|ch|sh)es$", last):
        return prefix + last[:-2]
    if last.endswith("s") and not last.endswith("ss"):
        return prefix + last[:-1]
    return noun


def _phrase(text: str, prompt: str) -> dict:
    words = text.split()
    if not words or words[0] not in NUMBERS:
        raise RewardError(f"reward 'geneval': cannot parse {text!r} in prompt {prompt!r}: expected '<a|an|one|two|…> [colour] <object>'; "
                          "pass GenEval metadata rows as metadata instead")
    count, rest = NUMBERS[words[0]], words[1:]
    color = rest.pop(0) if rest and rest[0] in COLORS and len(rest) > 1 else None
    if not rest:
        raise RewardError(f"reward 'geneval': no object in {text!r} (prompt {prompt!r})")
    noun = " ".join(rest)
    clause = {"class": singular(noun) if count > 1 else noun, "count": count}
    if color:
        clause["color"] = color
    return clause


def parse_prompt(prompt: str) -> dict:
    """GenEval metadata (``tag``, ``include``, ``exclude``) of a GenEval-style prompt.

    Forms (an optional ``"a photo of "`` first): ``"a bench"`` (single_object), ``"a red car"`` (colors),
    ``"three cups"`` (counting: ``include`` 3 and ``exclude`` 4), ``"a bench and a cow"`` (two_object),
    ``"a red car and a blue bench"`` (color_attr), ``"a dog right of a cat"`` (position: the target first,
    GenEval's order). A prompt outside these forms is a one-line ``RewardError``.
    """
    text = re.sub(r"\s+", " ", prompt.strip().lower().rstrip("."))
    text = re.sub(r"^(a photo of|an image of|a picture of) ", "", text)
    if "," in text:  # "a cat, a dog and a car": GenEval's forms join at most two objects, with "and" or a relation
        raise RewardError(f"reward 'geneval': {prompt!r} lists objects with commas (GenEval's forms name at most two); pass GenEval metadata rows as metadata")
    for rel in RELATIONS:
        parts = text.split(f" {rel} ")
        if len(parts) == 2:
            obj, target = _phrase(parts[0], prompt), _phrase(parts[1], prompt)
            return {"tag": "position", "include": [target, {**obj, "position": [rel, 0]}], "exclude": []}
    parts = text.split(" and ")
    if len(parts) == 2:
        a, b = _phrase(parts[0], prompt), _phrase(parts[1], prompt)
        tag = "color_attr" if "color" in a and "color" in b else "two_object"
        return {"tag": tag, "include": [a, b], "exclude": []}
    if len(parts) > 2:
        raise RewardError(f"reward 'geneval': {prompt!r} names more than two objects; pass GenEval metadata rows as metadata")
    clause = _phrase(text, prompt)
    if clause["count"] > 1:
        return {"tag": "counting", "include": [clause], "exclude": [{"class": clause["class"], "count": clause["count"] + 1}]}
    return {"tag": "colors" if "color" in clause else "single_object", "include": [clause], "exclude": []}


def relative_position(box_a, box_b, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """The relations of box ``a`` to box ``b`` (``xyxy``, y down) by GenEval's rule: the centre offset, shrunk on each
    axis by ``threshold`` × the two boxes' summed size on it (clamped at 0), then normalised by the raw offset's
    length; a component beyond ±0.5 gives left of / right of (x) or above / below (y)."""
    a, b = np.asarray(box_a, dtype=np.float64)[:4].reshape(2, 2), np.asarray(box_b, dtype=np.float64)[:4].reshape(2, 2)
    offset = a.mean(0) - b.mean(0)
    size = np.abs(a[1] - a[0]) + np.abs(b[1] - b[0])
    revised = np.maximum(np.abs(offset) - threshold * size, 0.0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {rel for rel, hit in (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5), ("below", dy > 0.5)) if hit}


def check(detections: dict[str, list[dict]], metadata: dict, position_threshold: float = POSITION_THRESHOLD) -> tuple[float, bool, list[str]]:
    """GenEval's rules on ``detections`` (``{class: [{"box": xyxy, "score", "color"?}, …]}``, most confident
    first). Returns ``(fraction of clauses that hold, all hold, reasons for the failures)``."""
    held, reasons, groups = [], [], []
    for req in metadata.get("include", []):
        name, count = req["class"], int(req["count"])
        found = detections.get(name, [])[:count]
        ok = len(found) >= count
        if not ok:
            reasons.append(f"expected {name} ≥ {count}, found {len(found)}")
        if ok and "color" in req:
            colors = [obj.get("color") for obj in found]
            if colors.count(req["color"]) < count:
                ok = False
                reasons.append(f"expected {count} {req['color']} {name}, found colours {colors}")
        if ok and "position" in req:
            rel, target = req["position"]
            if groups[target] is None:
                ok = False
                reasons.append(f"no target for {name} to be {rel}")
            else:
                for obj in found:
                    bad = next((t for t in groups[target] if rel not in relative_position(obj["box"], t["box"], position_threshold)), None)
                    if bad is not None:
                        ok = False
                        reasons.append(f"expected {name} {rel} its target, found {sorted(relative_position(obj['box'], bad['box'], position_threshold))}")
                        break
        held.append(ok)
        groups.append(found if ok else None)
    for req in metadata.get("exclude", []):
        n = len(detections.get(req["class"], []))
        ok = n < int(req["count"])
        if not ok:
            reasons.append(f"expected {req['class']} < {req['count']}, found {n}")
        held.append(ok)
    if not held:
        raise RewardError("reward 'geneval': the metadata has no include or exclude clause")
    return sum(held) / len(held), all(held), reasons


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of two ``xyxy`` boxes."""
    lt, rb = torch.maximum(a[:2], b[:2]), torch.minimum(a[2:], b[2:])
    inter = (rb - lt).clamp(min=0).prod()
    union = (a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod() - inter
    return inter / union if union > 0 else torch.zeros(())


@register_reward("geneval")
class GenEvalOwl(Reward):
    """GenEval's rules on OWLv2 detections (module docstring).

    Args:
        checkpoint: local folder of an ``Owlv2ForObjectDetection`` with its processor.
        random_init: random weights and the OpenAI CLIP tokenizer (tests); ``model_config``: ``Owlv2Config``
            keyword arguments (``text_config``, ``vision_config``, ``projection_dim``) for a tiny model.
        threshold, counting_threshold: sigmoid score a box needs (counting prompts use the second).
        max_objects: most boxes kept per class; nms_iou: greedy NMS overlap (1.0: none).
        position_threshold: GenEval's margin for relations.
        device, dtype, seed: where and in which dtype the detector runs; the random init's seed.
    """

    hub_weights = {"checkpoint": Weights("google/owlv2-base-patch16-ensemble", "model")}

    unit = "fraction of GenEval clauses that hold (geneval_strict: all of them, GenEval's correctness)"
    scale = (0.0, 1.0)
    input = "uint8"
    batch_size = 8

    def __init__(self, checkpoint: str | None = None, random_init: bool = False, model_config: dict | None = None,
                 threshold: float = 0.3, counting_threshold: float = 0.9, max_objects: int = 16, nms_iou: float = 1.0,
                 position_threshold: float = POSITION_THRESHOLD, device: str = "cpu", dtype: str = "float32", seed: int = 0):
        from transformers import AutoTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor

        for name, value in (("threshold", threshold), ("counting_threshold", counting_threshold)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"reward 'geneval': {name} must be in [0, 1], got {value}")
        if max_objects < 1 or not 0.0 < nms_iou <= 1.0:
            raise ValueError(f"reward 'geneval': max_objects must be ≥ 1 and nms_iou in (0, 1], got {max_objects}, {nms_iou}")
        self.threshold, self.counting_threshold, self.max_objects, self.nms_iou = float(threshold), float(counting_threshold), int(max_objects), float(nms_iou)
        self.position_threshold, self.device, self.dtype = float(position_threshold), device, _dtype(dtype)
        if random_init and checkpoint is None:
            config = dict(model_config or {})
            text = {"vocab_size": 49408, "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 0, **config.pop("text_config", {})}
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=config.pop("vision_config", {}), **config))
            self.tokenizer = openai_clip_tokenizer(model.config.text_config.max_position_embeddings)
            size = model.config.vision_config.image_size
            self.image_processor = Owlv2ImageProcessor(size={"height": size, "width": size})
        else:
            folder = self.weights_path("checkpoint", checkpoint, "a folder with an OWLv2 Owlv2ForObjectDetection and its processor")
            model = Owlv2ForObjectDetection.from_pretrained(str(folder), local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            self.image_processor = Owlv2ImageProcessor.from_pretrained(str(folder), local_files_only=True)
        self.model = model.to(device=device, dtype=self.dtype).eval().requires_grad_(False)
        self.max_length = int(model.config.text_config.max_position_embeddings)

    # -- detection ----------------------------------------------------------------------------------
    def _forward(self, image: torch.Tensor, queries: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores ``[boxes, queries]`` and ``xyxy`` boxes ``[boxes, 4]`` in the image's pixels."""
        pixels = self.image_processor(images=[image.permute(1, 2, 0).numpy()], return_tensors="pt")["pixel_values"]
        tokens = self.tokenizer(queries, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.no_grad():
            out = self.model(input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device),
                             pixel_values=pixels.to(self.device, self.dtype))
        scores = torch.sigmoid(out.logits[0].float()).cpu()
        cx, cy, w, h = out.pred_boxes[0].float().cpu().unbind(-1)
        side = float(max(image.shape[-2:]))  # OWLv2 pads to a square at the bottom and right: boxes are fractions of its side
        boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1) * side
        return scores, boxes

    def detect(self, image: torch.Tensor, metadata: dict) -> dict[str, list[dict]]:
        """``{class: [{"box", "score", "color"?}, …]}`` for the classes of ``metadata``, most confident first."""
        classes = list(dict.fromkeys([r["class"] for r in metadata.get("include", [])] + [r["class"] for r in metadata.get("exclude", [])]))
        colored = list(dict.fromkeys(r["class"] for r in metadata.get("include", []) if "color" in r))
        queries = [f"a photo of a {c}" for c in classes] + [f"a photo of a {color} {c}" for c in colored for color in COLORS]
        scores, boxes = self._forward(image, queries)
        cut = self.counting_threshold if metadata.get("tag") == "counting" else self.threshold
        found: dict[str, list[dict]] = {}
        for q, name in enumerate(classes):
            order = [int(i) for i in torch.argsort(scores[:, q], descending=True) if scores[i, q] > cut][: self.max_objects]
            kept = []
            while order:
                best = order.pop(0)
                kept.append(best)
                if self.nms_iou < 1.0:
                    order = [i for i in order if box_iou(boxes[best], boxes[i]) < self.nms_iou]
            objects = [{"box": boxes[i].tolist(), "score": float(scores[i, q])} for i in kept]
            if name in colored:
                base = len(classes) + colored.index(name) * len(COLORS)
                for obj, i in zip(objects, kept):
                    obj["color"] = COLORS[int(torch.argmax(scores[i, base : base + len(COLORS)]))]
            if objects:
                found[name] = objects
        return found

    # -- reward ---------------------------------------------------------------------------------------
    def specs(self, prompts: list[str], metadata: Any) -> list[dict]:
        """Each sample's GenEval metadata: the given rows (a list of dicts with ``include``), else parsed prompts."""
        if isinstance(metadata, (list, tuple)) and len(metadata) == len(prompts) and all(isinstance(m, dict) and "include" in m for m in metadata):
            return list(metadata)
        return [parse_prompt(p) for p in prompts]

    @classmethod
    def check_prompts(cls, prompts: list[str], metadata: list[dict | None]) -> None:
        """Every prompt has its GenEval row, or else every prompt parses (:meth:`specs` uses the rows only when all
        have one): a one-line ``RewardError`` naming the first prompt that does not, before anything is built."""
        if metadata and all(isinstance(m, dict) and "include" in m for m in metadata):
            return
        for prompt in dict.fromkeys(prompts):
            parse_prompt(prompt)

    def groups(self, prompts: list[str]) -> list[str | None]:
        """Each prompt's GenEval task type (``tag``), None where the prompt does not parse: evaluations report
        the score per task type (``diffrl.sampling.evaluation.group_means``), GenEval's table."""
        out: list[str | None] = []
        for p in prompts:
            try:
                out.append(parse_prompt(p)["tag"])
            except RewardError:
                out.append(None)
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8 or len(prompts) != images.shape[0]:
            raise RewardError(f"reward 'geneval': expected uint8 images [B, 3, H, W] and B prompts, got {images.dtype} {tuple(images.shape)} and {len(prompts)}")
        partial, strict = [], []
        for image, spec in zip(images.cpu(), self.specs(prompts, metadata)):
            fraction, correct, _ = check(self.detect(image, spec), spec, self.position_threshold)
            partial.append(fraction)
            strict.append(float(correct))
        return {self.name: torch.tensor(partial), f"{self.name}_strict": torch.tensor(strict)}


__all__ = ["COLORS", "GenEvalOwl", "box_iou", "check", "parse_prompt", "relative_position", "singular"]
