"""The reward protocol and registry.

A reward is a callable ``(images, prompts: list[str], metadata) -> dict[str, Tensor[B]]`` registered by
name. Names resolve, in order, from this registry (built-ins register on import), the ``diffrl.rewards``
entry-point group of installed packages, or a ``"module:Class"`` path (the module must be importable,
i.e. on ``sys.path``). See ``docs/rewards.md``.

A reward declares, as class or instance attributes (all optional; defaults in :class:`Reward`):

* ``name`` — registry name and the key of its main output;
* ``unit`` — what one number means (``"probability"``, ``"−kB"``);
* ``scale`` — ``(low, high)``, the closed range its main output lies in, or ``None`` (unbounded);
  :func:`score` raises when a value falls outside it;
* ``batch_size`` — the most images per call, or ``None`` (any); :func:`score` chunks the batch;
* ``input`` — ``"uint8"`` (``images`` is a uint8 tensor ``[B, 3, H, W]``) or ``"pil"`` (a list of
  ``B`` RGB ``PIL.Image.Image``); :func:`score` converts;
* ``device`` — where its model runs (informational; the reward moves tensors itself);
* ``video`` — ``False`` (default): a video ``[B, F, 3, H, W]`` is scored frame by frame as ``B·F`` images
  (each frame with its video's prompt; ``batch_size``/``input`` apply to frames) and a video's score is the
  mean over its frames; ``True``: the reward receives whole videos, uint8 ``[B, F, 3, H, W]`` (``"pil"``: a
  list of ``B`` lists of ``F`` RGB images), ``batch_size`` counting videos;
* ``needs_source`` — ``False`` (default); ``True``: an editing reward, called as
  ``reward(images, prompts, metadata, source_images=…)`` with each sample's source image in the same form as
  ``images`` (``input``), and ``prompts`` the edit instructions. Scoring without sources raises.

:func:`score` runs a weighted set of rewards and checks every output: a wrong shape, NaN or Inf (or a
value outside the declared ``scale``) raises :class:`RewardError` naming the reward and the sample's
index in the full batch (for videos: the video's index, and the frame's when scored per frame).
"""

from __future__ import annotations

import base64
import difflib
import importlib
import importlib.util
import io
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

import torch

from diffrl.hub import resolve_weights

_REGISTRY: dict[str, type] = {}
_BUILTIN_MODULES = (
    "rewards.digits", "rewards.jpeg", "rewards.ocr", "rewards.clip_models", "rewards.remote", "rewards.vlm_judge", "rewards.edit", "rewards.geneval", "rewards.image_reward",
    "rewards.hpsv3",
)
ENTRY_POINT_GROUP = "diffrl.rewards"
INPUT_KINDS = ("uint8", "pil")


class RewardError(RuntimeError):
    """A reward produced unusable output (wrong shape, NaN, Inf, out of scale) or could not be built or reached."""


@dataclass(frozen=True)
class Weights:
    """The published weights of one reward option: a Hub reference (``org/name`` for a folder,
    ``org/name/<file>`` for one file) and what of it is needed (``model`` | ``processor`` | ``file``,
    :func:`diffrl.hub.resolve_weights`)."""

    ref: str
    kind: str = "model"


class Reward:
    """Base class of rewards (subclassing is optional: any callable with the signature works).

    Attributes:
        name: the registry name; also the key of its main output.
        unit: what the number means (e.g. ``"probability"``).
        scale: ``(low, high)`` range of the main output, checked by :func:`score`; ``None``: unbounded.
        batch_size: most images per call (:func:`score` splits larger batches); ``None``: any number.
        input: ``"uint8"`` — ``images`` is a uint8 tensor ``[B, 3, H, W]``; ``"pil"`` — a list of RGB PIL images.
        device: where the reward model runs.
        video: ``True``: receives whole videos ``[B, F, 3, H, W]``; ``False``: videos are scored per frame
            and averaged over their frames (see the module docstring).
        needs_source: ``True``: an editing reward; receives ``source_images=`` (see the module docstring).

        hub_weights: option name → :class:`Weights`: the published weights an option loads when it is not given,
            so the reward works with no options online (or offline from the Hugging Face cache).

    Optional method ``groups(prompts) -> list[str | None]``: each prompt's group (GenEval's task type, say);
    evaluations then also report the reward's mean per group, ``eval/<name>/<group>``.
    """

    name: str = "reward"
    unit: str = "unspecified"
    scale: tuple[float, float] | None = None
    batch_size: int | None = None
    input: str = "uint8"
    device: str = "cpu"
    video: bool = False
    needs_source: bool = False
    hub_weights: ClassVar[dict[str, Weights]] = {}

    def __call__(self, images, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        raise TypeError(f"{type(self).__name__} must define __call__(images, prompts, metadata)")

    def weights_path(self, option: str, value: str | None, what: str) -> Path:
        """The local file or folder of option ``option``: ``value`` (a local path or a Hub reference), or the
        option's published weights (:attr:`hub_weights`) when ``value`` is ``None``.

        Raises:
            RewardError: no value and no published default; diffrl.hub.HubError: a Hub reference that cannot be
                had (offline and not cached names the fetch command); FileNotFoundError: a local path that does not exist.
        """
        spec = self.hub_weights.get(option)
        if value is None and spec is None:
            raise RewardError(f"reward {self.name!r} needs {what}: set +reward.options.{self.name}.{option}=<local path or Hub id> "
                              f"(or pass {option}=... to the constructor); random_init=true builds random weights (tests only)")
        ref = str(value if value is not None else spec.ref)
        path = resolve_weights(ref, spec.kind if spec else "model", key=f"+reward.options.{self.name}.{option}")
        if not path.exists():
            raise FileNotFoundError(f"reward {self.name!r}: {option}={ref!r} does not exist; it should be {what} (a local path or a Hub id)")
        return path

    @classmethod
    def check_prompts(cls, prompts: list[str], metadata: list[dict | None]) -> None:
        """Raise (``RewardError``, one line) before anything is built when ``prompts`` (each with its metadata row, None
        where it has none) cannot be scored by this reward, e.g. GenEval without a row and a prompt it cannot parse.
        The default accepts any prompts."""

    @classmethod
    def weight_refs(cls, options: dict) -> dict[str, Weights]:
        """Option → the weights a build with ``options`` loads (given or published), for checks before anything
        is built; none for an option not given under ``random_init``."""
        random_init = bool(options.get("random_init", False))
        return {opt: Weights(str(options[opt]) if options.get(opt) is not None else spec.ref, spec.kind)
                for opt, spec in cls.hub_weights.items() if options.get(opt) is not None or not random_init}


# optional packages of the built-in rewards: name -> (import name, the extra of pyproject.toml that installs it)
EXTRAS = {"clip_score": ("open_clip", "rewards"), "hpsv2": ("open_clip", "rewards"), "aesthetic": ("open_clip", "rewards"),
          "pickscore": ("open_clip", "rewards"), "geneval": ("open_clip", "rewards"), "ocr": ("rapidocr_onnxruntime", "rewards")}


def missing_extra(name: str, find_spec: Callable = importlib.util.find_spec) -> str | None:
    """One line naming the ``pip install`` that reward ``name`` needs when its optional package is not installed; None
    when nothing is missing (or the reward needs no extra)."""
    module, extra = EXTRAS.get(name, (None, None))
    if module is None or find_spec(module) is not None:
        return None
    return f"reward {name!r} needs the package {module!r}, which is not installed: pip install -e '.[{extra}]'"


def register_reward(name: str) -> Callable[[type], type]:
    """Class decorator registering a reward under ``name`` (sets ``cls.name``)."""

    def wrap(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def registered_names() -> list[str]:
    """Names of the built-in / decorated rewards and of the ``diffrl.rewards`` entry points."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    return sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def resolve_reward(name: str) -> Any:
    """The reward class (or factory / callable) for ``name`` (registry, entry point, or ``module:Class``)."""
    if name not in _REGISTRY:
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
    if name in _REGISTRY:
        return _REGISTRY[name]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as exc:
                raise RewardError(f"reward {name!r}: entry point {ep.value!r} of group {ENTRY_POINT_GROUP!r} failed to load ({exc})") from exc
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise RewardError(f"reward {name!r}: cannot import module {module_name!r} ({exc}); put its folder on sys.path / PYTHONPATH") from exc
        if not hasattr(module, attr):
            raise RewardError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
        return getattr(module, attr)
    names = registered_names()
    close = difflib.get_close_matches(name.replace("-", "_").lower(), names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"none of the {len(names)} registered rewards is close (docs/rewards.md lists them)"
    raise RewardError(f"unknown reward {name!r}: {hint} Or give an entry point of group {ENTRY_POINT_GROUP!r} or a 'module:Class' path")


def build_reward(name: str, **kwargs) -> Callable:
    """Resolve ``name`` and build it: a class is instantiated with ``kwargs``; a plain function is used as is.

    The declared attributes are validated (:func:`reward_spec`) so that a bad ``input`` or ``batch_size``
    fails here, not in the middle of a run.
    """
    return instantiate_reward(name, resolve_reward(name), kwargs)


def instantiate_reward(name: str, target: Any, options: Mapping[str, Any] | None = None) -> Callable:
    """Build reward ``name`` from its resolved ``target`` (:func:`resolve_reward`): a class is instantiated with
    ``options``, a plain function is used as is; its declared attributes validated (:func:`reward_spec`)."""
    kwargs = dict(options or {})
    if isinstance(target, type):
        try:
            reward = target(**kwargs)
        except TypeError as exc:
            raise RewardError(f"reward {name!r}: cannot build {target.__name__}(**{kwargs}) ({exc}); check reward.options") from exc
    elif callable(target):
        if kwargs:
            raise RewardError(f"reward {name!r} is a function and takes no options; got {sorted(kwargs)}")
        reward = target
    else:
        raise RewardError(f"reward {name!r} resolved to {type(target).__name__}, which is not callable")
    if not getattr(reward, "name", None) or reward.name == Reward.name:
        reward.name = name
    reward_spec(reward, name)
    return reward


def reward_spec(fn: Any, name: str | None = None) -> dict[str, Any]:
    """The declared attributes of ``fn`` with defaults filled in; raises :class:`RewardError` when invalid."""
    name = name or getattr(fn, "name", None) or getattr(fn, "__name__", "reward")
    spec = {key: getattr(fn, key, getattr(Reward, key)) for key in ("unit", "scale", "batch_size", "input", "device", "video", "needs_source")}
    spec["video"] = bool(spec["video"])
    spec["needs_source"] = bool(spec["needs_source"])
    spec["name"] = getattr(fn, "name", None) or name
    if spec["input"] not in INPUT_KINDS:
        raise RewardError(f"reward {name!r} declares input={spec['input']!r}; use one of {INPUT_KINDS}")
    bs = spec["batch_size"]
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
        raise RewardError(f"reward {name!r} declares batch_size={bs!r}; use a positive int or None")
    scale = spec["scale"]
    if scale is not None:
        if len(scale) != 2 or not float(scale[0]) <= float(scale[1]):
            raise RewardError(f"reward {name!r} declares scale={scale!r}; use (low, high) with low <= high, or None")
        spec["scale"] = (float(scale[0]), float(scale[1]))
    return spec


def check_output(
    name: str, value: Any, batch_size: int, *, first_index: int = 0, scale: tuple[float, float] | None = None,
    frames: int | None = None,
) -> torch.Tensor:
    """Validate one reward output: a tensor of shape ``[B]``, finite, and inside ``scale`` if given.

    ``first_index`` is the index of this chunk's first sample in the full batch, so that errors name the
    sample the caller knows. ``frames``: the samples are the frames of videos of ``frames`` frames each
    (flattened), and errors name ``video i (frame j)``.
    """

    def sample(i: int) -> str:
        if frames:
            return f"video {i // frames} (frame {i % frames})"
        return f"sample {i}"

    if not isinstance(value, torch.Tensor):
        raise RewardError(f"reward {name!r} returned {type(value).__name__}, expected a tensor of shape [{batch_size}]")
    if value.shape != (batch_size,):
        where = f" for samples {first_index}..{first_index + batch_size - 1}" if first_index else ""
        raise RewardError(f"reward {name!r} returned shape {tuple(value.shape)}{where}, expected [{batch_size}]")
    value = value.detach().float().cpu()
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RewardError(
            f"reward {name!r} returned {value[i].item()} for {sample(first_index + i)} ({int(bad.sum())} non-finite of {batch_size}); "
            "fix the reward so that it returns finite scores"
        )
    if scale is not None:
        low, high = scale
        tol = 1e-6 * max(1.0, abs(low), abs(high))
        out = (value < low - tol) | (value > high + tol)
        if bool(out.any()):
            i = int(out.nonzero()[0, 0])
            raise RewardError(
                f"reward {name!r} returned {value[i].item()} for {sample(first_index + i)}, outside its declared scale "
                f"[{low}, {high}]; fix the reward or its `scale` attribute"
            )
    return value


def to_pil(images: torch.Tensor) -> list:
    """uint8 ``[B, 3, H, W]`` → ``B`` RGB ``PIL.Image.Image`` (exact: pixel ``(y, x)`` = ``images[b, :, y, x]``)."""
    from PIL import Image

    array = images.detach().cpu().permute(0, 2, 3, 1).contiguous().numpy()
    return [Image.fromarray(a) for a in array]


def from_pil(pil_images: list) -> torch.Tensor:
    """``B`` PIL images of one size → uint8 ``[B, 3, H, W]`` (converted to RGB)."""
    import numpy as np

    arrays = [np.asarray(im.convert("RGB")) for im in pil_images]
    sizes = {a.shape for a in arrays}
    if len(sizes) > 1:
        raise ValueError(f"images have different sizes {sorted(sizes)}; resize them to one size first")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def check_images(images: Any, prompts: list[str]) -> None:
    """Raise ``ValueError`` unless ``images`` is uint8 ``[B, 3, H, W]`` (or videos ``[B, F, 3, H, W]``) with
    ``B == len(prompts)``."""
    ok = isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.ndim in (4, 5) and images.shape[-3] == 3
    if not ok:
        got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(
            f"rewards take uint8 images [B, 3, H, W], got {got} (videos: uint8 [B, F, 3, H, W]); convert floats in [0, 1] "
            "with (x * 255).round().to(torch.uint8)"
        )
    if len(prompts) != images.shape[0]:
        kind = "videos" if images.ndim == 5 else "images"
        raise ValueError(f"got {len(prompts)} prompts for {images.shape[0]} {kind}")


def slice_metadata(metadata: Any, start: int, stop: int, batch_size: int) -> Any:
    """Per-sample metadata (a list/tuple of length B) is sliced with the chunk; anything else is shared."""
    if isinstance(metadata, (list, tuple)) and len(metadata) == batch_size:
        return metadata[start:stop]
    return metadata


def call_reward(
    name: str, fn: Callable, images: torch.Tensor, prompts: list[str], metadata: Any = None, source_images: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Call one reward the way it declared: in chunks of ``fn.batch_size``, on uint8 tensors or PIL images.

    Every output of every chunk is checked (:func:`check_output`; the main output also against
    ``fn.scale``) and the chunks are concatenated, so the result is ``{key: float Tensor[B]}`` on CPU and
    equal to one call on the whole batch for any per-sample reward.

    Videos ``[B, F, 3, H, W]``: a reward declaring ``video = True`` receives them whole (chunks of
    ``batch_size`` videos); any other reward scores the ``B·F`` frames as images (prompt and per-sample
    metadata repeated per frame) and every output is the mean over each video's frames:
    ``r(video b) = (1/F)·Σ_f r(frame f of b)``.

    Args:
        name: the reward's name in the config (used in errors; also the main output's key when present).
        fn: the reward callable.
        images: uint8 ``[B, 3, H, W]`` or videos ``[B, F, 3, H, W]``.
        prompts: ``B`` prompts.
        metadata: passed through; a list/tuple of length ``B`` is sliced per chunk (repeated per frame).
        source_images: uint8 ``[B, 3, H, W]``, the source image of each sample of an editing run; passed to a
            reward declaring ``needs_source`` (sliced with the chunks, repeated per frame), ignored by others.
    """
    check_images(images, prompts)
    spec = reward_spec(fn, name)
    if spec["needs_source"]:
        if source_images is None:
            raise RewardError(f"reward {name!r} scores edits and needs the source images (needs_source = True); this run has none: use it with an editing model and editing prompts")
        if source_images.dtype != torch.uint8 or source_images.ndim != 4 or source_images.shape[0] != images.shape[0]:
            raise RewardError(f"reward {name!r}: source_images must be uint8 [{images.shape[0]}, 3, H, W], got {source_images.dtype} {tuple(source_images.shape)}")
    else:
        source_images = None
    if images.ndim == 5 and not spec["video"]:
        b, f = images.shape[:2]
        frames = images.reshape(b * f, *images.shape[2:])
        frame_prompts = [p for p in prompts for _ in range(f)]
        if isinstance(metadata, (list, tuple)) and len(metadata) == b:
            metadata = [m for m in metadata for _ in range(f)]
        frame_sources = None if source_images is None else source_images.repeat_interleave(f, dim=0)
        per_frame = _call_chunks(name, fn, spec, frames, frame_prompts, metadata, frames_per_video=f, sources=frame_sources)
        return {key: value.view(b, f).mean(dim=1) for key, value in per_frame.items()}
    return _call_chunks(name, fn, spec, images, prompts, metadata, sources=source_images)


def _call_chunks(
    name: str, fn: Callable, spec: dict, images: torch.Tensor, prompts: list[str], metadata: Any, frames_per_video: int | None = None,
    sources: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`call_reward`'s loop over chunks of ``spec["batch_size"]`` samples (images, frames or videos)."""
    total = images.shape[0]
    chunk = spec["batch_size"] or max(total, 1)
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        batch = images[start:stop]
        if spec["input"] == "pil":
            batch_in = [to_pil(video) for video in batch] if batch.ndim == 5 else to_pil(batch)
        else:
            batch_in = batch
        args = (batch_in, list(prompts[start:stop]), slice_metadata(metadata, start, stop, total))
        if sources is not None:
            src = sources[start:stop]
            result = fn(*args, source_images=to_pil(src) if spec["input"] == "pil" else src)
        else:
            result = fn(*args)
        if not isinstance(result, dict) or not result:
            raise RewardError(f"reward {name!r} returned {type(result).__name__}; expected a dict of name -> tensor [B]")
        if parts and set(result) != set(parts):
            raise RewardError(f"reward {name!r} returned keys {sorted(result)} for samples {start}..{stop - 1} but {sorted(parts)} before")
        main = _main_key(name, fn, result)
        for key, value in result.items():
            checked = check_output(
                key, value, stop - start, first_index=start, scale=spec["scale"] if key == main else None, frames=frames_per_video,
            )
            parts.setdefault(key, []).append(checked)
    if not parts:  # an empty batch
        return {getattr(fn, "name", None) or name: torch.zeros(0)}
    return {key: torch.cat(values) for key, values in parts.items()}


def _main_key(name: str, fn: Callable, result: dict) -> str:
    """The key of the main output: the config name, else the reward's ``name``, else the first key."""
    for key in (name, getattr(fn, "name", None)):
        if key in result:
            return key
    return next(iter(result))


def score(
    rewards: dict[str, tuple[Callable, float]], images: torch.Tensor, prompts: list[str], metadata: Any = None, source_images: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Run every reward and return ``{"reward/<key>": [B], …, "rewards": Σ weight·main output}``.

    ``"reward/<name>"`` always holds the main output of the reward configured as ``name`` (also when the
    reward's own output key differs, e.g. ``remote``), next to every key the reward returned.

    Each reward is called through :func:`call_reward` (its ``batch_size`` and ``input`` honoured, every
    output checked). The main output of reward ``name`` is ``result[name]``, else ``result[fn.name]``,
    else its first key.

    Args:
        rewards: ``name -> (callable, weight)``.
        images: uint8 ``[B, 3, H, W]`` or videos ``[B, F, 3, H, W]`` (see :func:`call_reward`).
        prompts: ``B`` prompts.
        metadata: passed to every reward (a list/tuple of length ``B`` is sliced with the chunks).
        source_images: uint8 ``[B, 3, H, W]`` sources of an editing run, for the rewards that declare
            ``needs_source``.
    """
    check_images(images, prompts)
    batch_size = images.shape[0]
    out: dict[str, torch.Tensor] = {}
    total = torch.zeros(batch_size)
    for name, (fn, weight) in rewards.items():
        result = call_reward(name, fn, images, prompts, metadata, source_images)
        for key, value in result.items():
            out[f"reward/{key}"] = value
        main = result[_main_key(name, fn, result)]
        out[f"reward/{name}"] = main  # per-reward advantages look rewards up by their config name
        total = total + float(weight) * main
    out["rewards"] = total
    return out


# -- the wire format of remote rewards (rewards.remote, diffrl.tools.reward_server) ----------------------
TOKEN_ENV = "DIFFRL_REWARD_TOKEN"
"""environment variable holding the bearer token of a reward server"""


def encode_png(image: torch.Tensor) -> str:
    """uint8 ``[3, H, W]`` → base64 text of a lossless PNG (fast compression)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.detach().cpu().permute(1, 2, 0).contiguous().numpy()).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(text: str, max_pixels: int = 4096 * 4096) -> torch.Tensor:
    """base64 PNG → uint8 ``[3, H, W]`` (RGB); ``ValueError`` naming the problem when it is not one."""
    import numpy as np
    from PIL import Image

    if not isinstance(text, str):
        raise ValueError(f"an image must be a base64 PNG string, got {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise ValueError(f"an image is not valid base64 ({exc})") from exc
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ValueError("an image is not a PNG (send PNG, lossless; JPEG would change the pixels)")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > max_pixels:
                raise ValueError(f"an image has {im.width}x{im.height} pixels, more than the limit {max_pixels}")
            array = np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError) as exc:
        raise ValueError(f"an image is a corrupt PNG ({exc})") from exc
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
