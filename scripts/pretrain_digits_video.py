"""Make the digits-video miniature's shipped files: the training reward's two nets and the base generator.

    python scripts/pretrain_digits_video.py --out assets/digits_video

Seeded end to end (``--seed``), ≤ 15 minutes on 2 CPU cores. Steps:

1. The reward's frame classifier (:class:`~rewards.digits.classifiers.DigitsClassifier` ``cnn``, seed 1) learns digit and
   colour from single frames of clips of the **reward part** of sklearn's digits (``video_split``), with light
   augmentation (intensity scale, Gaussian pixel noise, a blur of random strength); the motion net
   (:class:`~rewards.digits.video.MotionNet`, seed 2) learns left/right/up/down/still from whole clips of the same
   part (20 % still), with the same augmentation and a per-frame brightness flicker. Both are checked on clips of
   the judge part, which they never saw.
2. The generator (tiny ``WanTransformer3DModel`` + the digits text encoder over the video words, trained jointly)
   learns rectified flow on clips of the reward and free parts on tracks near the middle (``--track-jitter``;
   ``x_σ = (1 − σ)x0 + σε``, ``v = ε − x0``, logit-normal σ, ``--cond-dropout`` empty prompts for CFG). The transformer
   predicts the clean clip (``--prediction clean``; the adapter turns it into the velocity ``(x_σ − x̂0)/σ`` and the
   loss is on the velocity): with 96 pixel values per 2×4×4 patch and a 128-wide model, predicting the velocity (a
   noise-sized target) left the frames speckled and unmoving, as "Back to Basics: Let Denoising Generative Models
   Denoise" (Li & He, 2025) finds for large pixel patches. AdamW at ``--lr`` with ``--warmup`` steps, then constant
   (``--lr-schedule constant``; a cosine decay to 0 at step 2800 left the base at gold 0.06, a constant rate at 0.16 to
   0.47 on one GPU); EMA ``--ema`` of the weights evaluated and saved. It is left imperfect on purpose, most of all on
   motion: ``--direction-noise`` (35 %) of the training prompts name a random direction and ``--colour-noise`` a
   random colour, so the base follows the prompt only part of the time and RL has room. Every ``--eval-every`` steps
   the trainer's evaluation runs (every prompt × ``--eval-seeds`` held-out seeds ``eval.seed=1234``, 10 ODE steps,
   guidance 1) with the gold judge, its four properties, the realness check, the second judge and the training reward.
3. ``metadata.json`` records the settings, the nets' held-out accuracies, the history and the base's scores;
   ``pretrain_log.txt`` the printed log. The gold judge has no files: it is rules and nearest neighbours over the
   judge part (``rewards.digits.video_judge``).

The shipped base is these defaults: 79 s for the reward nets and 772 s for the generator (2800 steps) on the 2-core
work machine. On 240 prompts × 2 held-out seeds: gold 0.16, identity 0.37, colour 0.94, direction 0.65, consistency
0.46, realness 0.24 (``benchmarks/RESULTS.md``, "The digits video miniature", has the settings tried and how each
scored; ``benchmarks/learning/digits_video_base_sweep.sh`` is the same comparison for one GPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import evaluate
from pipelines.digits_video.adapter import TRANSFORMER_CONFIG, DigitsVideoAdapter
from pipelines.schedules import logit_normal_sigmas
from rewards.base import build_reward
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.video import MotionNet, frame_probabilities
from rewards.digits.video_data import (
    COLOUR_NAMES,
    DIRECTION_NAMES,
    FRAMES,
    load_digits_8,
    make_prompt,
    random_clips,
    to_uint8,
    video_split,
)

METRICS = ("digits_video", "digits_video_gold", "digits_video_gold_identity", "digits_video_gold_colour", "digits_video_gold_direction",
           "digits_video_gold_consistency", "digits_video_real", "digits_video_fidelity", "digits_video_gold2")


def augment(clips: torch.Tensor, g: torch.Generator, flicker: float = 0.0) -> torch.Tensor:
    """Per clip: intensity scale in [0.7, 1.2], a 3×3 box blur mixed in with weight in [0, 0.6], Gaussian noise σ ≤ 0.08;
    per frame: brightness × (1 ± ``flicker``); clamped to [0, 1]."""
    n = clips.shape[0]
    shape = (n, 1, 1, 1, 1)
    frames = clips.flatten(0, 1)
    blurred = F.avg_pool2d(frames, 3, stride=1, padding=1, count_include_pad=False).view_as(clips)
    mix = 0.6 * torch.rand(shape, generator=g)
    x = ((1 - mix) * clips + mix * blurred) * (0.7 + 0.5 * torch.rand(shape, generator=g))
    if flicker:
        x = x * (1 + flicker * (2 * torch.rand(n, FRAMES, 1, 1, 1, generator=g) - 1))
    x = x + 0.08 * torch.rand(shape, generator=g) * torch.randn(x.shape, generator=g)
    return x.clamp(0, 1)


def held_out_clips(n: int = 600, seed: int = 99):
    """Clips of the judge part (never seen by the reward nets or the generator), uint8-rounded, 20 % still."""
    intensity, labels = load_digits_8()
    idx = video_split(len(labels))["judge"]
    clips, digit, colour, direction = random_clips(intensity[idx], labels[idx], n, torch.Generator().manual_seed(seed), still_fraction=0.2)
    return to_uint8(clips).float() / 255.0, digit, colour, direction


def train_frame_classifier(steps: int, seed: int = 1) -> tuple[DigitsClassifier, dict]:
    intensity, labels = load_digits_8()
    idx = video_split(len(labels))["reward"]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DigitsClassifier("cnn")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(steps):
        clips, digit, colour, _ = random_clips(intensity[idx], labels[idx], 128, g, still_fraction=0.2)
        frame = torch.randint(0, FRAMES, (128,), generator=g)
        x = augment(clips, g)[torch.arange(128), frame]
        d_logits, c_logits = model(x)
        loss = F.cross_entropy(d_logits, digit) + F.cross_entropy(c_logits, colour)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    clips, digit, colour, _ = held_out_clips()
    with torch.no_grad():
        p_digit, p_colour = frame_probabilities(model, clips)
    meta = {"architecture": "cnn (DigitsClassifier) on single frames", "seed": seed, "part": "reward", "steps": steps,
            "held_out_frame_digit_accuracy": (p_digit.argmax(-1) == digit[:, None]).float().mean().item(),
            "held_out_frame_colour_accuracy": (p_colour.argmax(-1) == colour[:, None]).float().mean().item()}
    return model, meta


def train_motion_net(steps: int, seed: int = 2) -> tuple[MotionNet, dict]:
    intensity, labels = load_digits_8()
    idx = video_split(len(labels))["reward"]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = MotionNet()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(steps):
        clips, _, _, direction = random_clips(intensity[idx], labels[idx], 64, g, still_fraction=0.2)
        loss = F.cross_entropy(model(augment(clips, g, flicker=0.15)), direction)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    clips, _, _, direction = held_out_clips()
    with torch.no_grad():
        accuracy = (model(clips).argmax(-1) == direction).float().mean().item()
    return model, {"architecture": "MotionNet (3-D convs over the clip's ink)", "seed": seed, "part": "reward", "steps": steps,
                   "held_out_direction_accuracy": accuracy}


def evaluate_base(adapter: DigitsVideoAdapter, metrics: dict, seeds_per_prompt: int, eval_seed: int = 1234, guidance: float = 1.0) -> dict:
    """The trainer's evaluation (every prompt × held-out seeds, 10 ODE steps, guidance 1 as the recipes): the means of ``metrics``."""
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), seeds_per_prompt, eval_seed)
    scores, _ = evaluate(adapter, prompts, seeds=seeds, num_steps=10, guidance_scale=guidance, metrics=metrics)
    return {k[len("eval/"):]: round(v, 4) for k, v in scores.items()}


def training_prompts(digit, colour, direction, args, g: torch.Generator) -> list[str]:
    """The prompts of a batch of clips: a share ``--direction-noise`` names a random direction, ``--colour-noise`` a
    random colour, and ``--cond-dropout`` are emptied."""
    n = len(digit)
    said_direction, said_colour = direction.clone(), colour.clone()
    noisy = torch.rand(n, generator=g) < args.direction_noise
    said_direction[noisy] = torch.randint(0, len(DIRECTION_NAMES), (int(noisy.sum()),), generator=g)
    noisy = torch.rand(n, generator=g) < args.colour_noise
    said_colour[noisy] = torch.randint(0, len(COLOUR_NAMES), (int(noisy.sum()),), generator=g)
    drop = (torch.rand(n, generator=g) < args.cond_dropout).tolist()
    return ["" if dr else make_prompt(int(d), int(c), int(m)) for d, c, m, dr in zip(digit, said_colour, said_direction, drop)]


def learning_rate_factor(step: int, args) -> float:
    """``--lr``'s factor at optimizer step ``step``: linear warmup over ``--warmup`` steps, then constant or (``--lr-schedule
    cosine``) a half cosine down to 0 at ``--max-steps``."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if args.lr_schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))))


def generator_config(args) -> dict:
    """The shipped architecture (``TRANSFORMER_CONFIG``) with the ``--patch``/``--heads``/``--ffn``/``--layers`` changes."""
    cfg = dict(TRANSFORMER_CONFIG)
    if args.patch:
        cfg["patch_size"] = tuple(int(v) for v in args.patch.split(","))
    for key, value in (("num_attention_heads", args.heads), ("ffn_dim", args.ffn), ("num_layers", args.layers)):
        if value:
            cfg[key] = value
    return cfg


def generator_class(args) -> type[DigitsVideoAdapter]:
    cfg = generator_config(args)
    if cfg == TRANSFORMER_CONFIG and args.prediction == DigitsVideoAdapter.prediction:
        return DigitsVideoAdapter
    return type("DigitsVideoSweepAdapter", (DigitsVideoAdapter,), {"transformer_config": cfg, "prediction": args.prediction})


def train_generator(metrics: dict, args, log) -> tuple[DigitsVideoAdapter, dict]:
    intensity, labels = load_digits_8()
    split = video_split(len(labels))
    idx = torch.cat([split["reward"], split["free"]])
    intensity, labels = intensity[idx], labels[idx]
    torch.manual_seed(args.seed)
    adapter = generator_class(args)(path=None, seed=args.seed, device=args.device)
    te = adapter.text_encoder.requires_grad_(True).train()
    model = adapter.denoiser.train()
    params = list(model.parameters()) + list(te.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: learning_rate_factor(i, args))
    g = torch.Generator().manual_seed(args.seed)
    history, t0, step = [], time.time(), 0

    def ema_adapter() -> DigitsVideoAdapter:
        frozen = copy.deepcopy(adapter)
        with torch.no_grad():
            for p, e in zip([*frozen.denoiser.parameters(), *frozen.text_encoder.parameters()], ema):
                p.copy_(e)
        frozen.denoiser.eval().requires_grad_(False)
        frozen.text_encoder.eval().requires_grad_(False)
        return frozen

    for step in range(1, args.max_steps + 1):
        clips, digit, colour, direction = random_clips(intensity, labels, args.batch_size, g, jitter=None if args.track_jitter < 0 else args.track_jitter)
        x0 = adapter.encode_videos(to_uint8(clips).float() / 255.0)
        prompts = training_prompts(digit, colour, direction, args, g)
        seq, pooled = te.encode(prompts)
        sigma = logit_normal_sigmas(args.batch_size, generator=g)
        eps = torch.randn(x0.shape, generator=g)
        x0, sigma, eps = x0.to(args.device), sigma.to(args.device), eps.to(args.device)
        s = sigma.view(-1, 1, 1, 1, 1)
        v = adapter._forward((1 - s) * x0 + s * eps, sigma, {"prompt_embeds": seq, "pooled_prompt_embeds": pooled})
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - min(args.ema, (1 + step) / (10 + step)))
        minutes = (time.time() - t0) / 60
        if minutes >= args.max_minutes:
            log(json.dumps({"stopped": f"--max-minutes {args.max_minutes} reached", "step": step}))
            break
        if step % 100 == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 5), "seconds": round(time.time() - t0, 1)}), flush=True)
        if step % args.eval_every == 0 and step < args.max_steps:
            scores = evaluate_base(ema_adapter(), metrics, args.eval_seeds)
            history.append({"step": step, "loss": round(loss.item(), 5), **scores, "seconds": round(time.time() - t0, 1)})
            log(json.dumps(history[-1]))
    final = ema_adapter()
    return final, {"steps": step, "history": history, "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_video")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                    help="after the warmup: constant, or a half cosine to 0 at --max-steps")
    ap.add_argument("--warmup", type=int, default=200, help="linear learning-rate warmup steps")
    ap.add_argument("--ema", type=float, default=0.995, help="EMA decay of the weights that are evaluated and saved")
    ap.add_argument("--cond-dropout", type=float, default=0.1)
    ap.add_argument("--direction-noise", type=float, default=0.35, help="share of training prompts that name a random direction")
    ap.add_argument("--colour-noise", type=float, default=0.1, help="share of training prompts that name a random colour")
    ap.add_argument("--track-jitter", type=int, default=0,
                    help="the generator's clips run on tracks at the centre ± this many px across the motion (-1: anywhere, as the reward nets' clips)")
    ap.add_argument("--max-steps", type=int, default=2800)
    ap.add_argument("--max-minutes", type=float, default=1000.0, help="also stop the generator's training after this much wall time")
    ap.add_argument("--eval-every", type=int, default=1400)
    ap.add_argument("--eval-seeds", type=int, default=2, help="held-out seeds per prompt of each evaluation (the recipes' eval.seeds_per_prompt)")
    ap.add_argument("--classifier-steps", type=int, default=1000)
    ap.add_argument("--motion-steps", type=int, default=600)
    ap.add_argument("--patch", default="", help="patch size 'frames,rows,cols' (default: the shipped TRANSFORMER_CONFIG's)")
    ap.add_argument("--heads", type=int, default=0, help="attention heads of 32 dims (default: the shipped config's)")
    ap.add_argument("--ffn", type=int, default=0, help="feed-forward width (default: the shipped config's)")
    ap.add_argument("--prediction", choices=("velocity", "clean"), default=DigitsVideoAdapter.prediction,
                    help="what the transformer outputs: the velocity, or the clean clip (turned into the velocity)")
    ap.add_argument("--layers", type=int, default=0, help="transformer blocks (default: the shipped config's)")
    ap.add_argument("--reuse-reward-nets", action="store_true", help="load reward_frames/ and reward_motion/ from --out instead of training them")
    ap.add_argument("--eval-guidance", type=float, default=1.0, help="CFG scale of the evaluations (the recipes evaluate at 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (the shipped base) or cuda (sweeps; other numerics)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    t0 = time.time()
    if args.reuse_reward_nets:
        missing = [str(out / f) for f in ("metadata.json", "reward_frames", "reward_motion") if not (out / f).exists()]
        if missing:
            ap.error(f"--reuse-reward-nets needs a folder made by this script; missing {', '.join(missing)} (copy them from assets/digits_video or drop the flag)")
        old = json.loads((out / "metadata.json").read_text())
        frames_meta, motion_meta = old["reward_frames"], old["reward_motion"]
    else:
        frames, frames_meta = train_frame_classifier(args.classifier_steps)
        frames.save_pretrained(out / "reward_frames")
        log(json.dumps({"reward_frames": frames_meta, "seconds": round(time.time() - t0, 1)}))
        motion, motion_meta = train_motion_net(args.motion_steps)
        motion.save_pretrained(out / "reward_motion")
        log(json.dumps({"reward_motion": motion_meta, "seconds": round(time.time() - t0, 1)}))
    metrics = {name: build_reward(name, path=str(out)) if name == "digits_video" else build_reward(name) for name in METRICS}
    adapter, gen_meta = train_generator(metrics, args, log)
    adapter.save_pretrained(out)
    base = evaluate_base(adapter, metrics, args.eval_seeds)
    if args.eval_guidance != 1.0:
        log(json.dumps({"base_guidance": args.eval_guidance, **evaluate_base(adapter, metrics, args.eval_seeds, guidance=args.eval_guidance)}))
    meta = {"args": vars(args), "reward_frames": frames_meta, "reward_motion": motion_meta, "generator": gen_meta, "base": base,
            "seconds": round(time.time() - t0, 1)}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    log(json.dumps({"base": base, "seconds": meta["seconds"]}))
    (out / "pretrain_log.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
