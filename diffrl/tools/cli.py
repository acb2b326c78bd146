"""``diffrl`` command line.

    diffrl train [key=value ...]          run a recipe (default: experiment=digits_flow_grpo on CPU)
    diffrl train --cfg job [key=value …]  print the composed config (yaml) and exit, as Hydra's --cfg job
    diffrl sample / eval / export-lora    sample images, evaluate, export the LoRA (diffrl.tools.commands)
    diffrl serve-reward reward=<name>     serve a registered reward over HTTP (diffrl.tools.reward_server)
    diffrl plan [key=value ...] --gpus N  will the recipe fit, how long will a step take (CPU only; diffrl.tools.plan)
    diffrl prompts convert --format F IN OUT   flow_grpo's GenEval, OCR and counting-edit files as diffrl records

Overrides use hydra syntax: ``diffrl train experiment=digits_flow_grpo trainer.steps=20
trainer.output_dir=runs/a``. Errors in the config, missing files and failing rewards print one line
naming the cause (set ``DIFFRL_TRACEBACK=1`` for the full traceback) and exit with status 2; a run that
stops on a fault (a reward down, a full disk, a lost worker) prints the cause and the checkpoint that
``trainer.resume=auto`` continues from, and exits with status 3.

This module imports nothing heavy: ``diffrl --help`` and ``diffrl train --help`` answer from it alone (well under a
second), and every command runs through :func:`diffrl.tools.commands.main`, imported by name (``RUNNER``) once a
command is given, since it brings torch, diffusers and the models (~5 s).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # diffrl.recipes.CONFIG_DIR, without importing it
RUNNER = "diffrl.tools.commands"  # the commands' module: parsers and handlers (imported by name: it brings torch)
COMMANDS = {
    "train": "run a training recipe",
    "sample": "sample images for prompts and score them",
    "eval": "evaluate on held-out prompts with fixed seeds",
    "export-lora": "export a checkpoint's LoRA in the diffusers format",
    "serve-reward": "serve a registered reward over HTTP",
    "plan": "will a recipe fit on my GPUs, and how long will a step take (CPU only)",
    "prompts": "convert flow_grpo's prompt datasets (GenEval, OCR, counting edits) to diffrl records",
}


def recipe_names() -> list[str]:
    """The recipes ``experiment=<name>`` selects: ``configs/experiment/*.yaml``."""
    return sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def _columns(names: list[str], width: int = 110) -> str:
    size = max(map(len, names)) + 2
    per_line = max(1, (width - 2) // size)
    return "\n".join("  " + "".join(n.ljust(size) for n in names[i : i + per_line]).rstrip() for i in range(0, len(names), per_line))


def add_train_parser(sub) -> argparse.ArgumentParser:
    """``diffrl train``: its overrides, ``--cfg job``, and a help that lists the recipes and ``+shrink=tiny``."""
    epilog = (f"recipes (experiment=<name>, configs/experiment/):\n{_columns(recipe_names())}\n\n"
              "+shrink=tiny      any recipe as a seconds-long CPU run: tiny random models, 32 px, 2 steps of 2 prompts x 3 samples\n"
              "                  (configs/shrink/tiny.yaml), e.g. diffrl train experiment=sd35m_geneval_flow_grpo +shrink=tiny\n"
              "groups            model=, algorithm=, reward=, sampler= (configs/<group>/*.yaml); any key: trainer.steps=20\n"
              "--cfg job         print the composed config and exit (nothing is built)")
    train = sub.add_parser("train", help=COMMANDS["train"], epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="run a training recipe; overrides as key=value (hydra syntax). With no overrides: "
                           "experiment=digits_flow_grpo on the CPU")
    train.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=digits_flow_grpo trainer.steps=20")
    train.add_argument("--cfg", choices=["job"], default=None, help="print the composed config (yaml) and exit, as Hydra's --cfg job")
    return train


def _help_parser() -> argparse.ArgumentParser:
    """The top-level parser for help and usage errors: every command named, ``train`` in full; nothing imported."""
    parser = argparse.ArgumentParser(prog="diffrl", description="RL post-training of diffusion and flow-matching models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    for name, text in COMMANDS.items():
        if name != "train":
            sub.add_parser(name, help=text, add_help=False)
    return parser


def _cfg_first(argv: list[str]) -> list[str]:
    """``train … --cfg job …`` with ``--cfg job`` moved right after ``train``, so that it may stand anywhere among the
    overrides (as with Hydra)."""
    rest, cfg, i = [], [], 1
    while i < len(argv):
        if argv[i] == "--cfg" and i + 1 < len(argv):
            cfg, i = ["--cfg", argv[i + 1]], i + 2
            continue
        if argv[i].startswith("--cfg="):
            cfg = [argv[i]]
        else:
            rest.append(argv[i])
        i += 1
    return [argv[0], *cfg, *rest]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):  # a misspelt command: the closest, one line
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        print(f"diffrl: error: no command {argv[0]!r}{hint}; commands: {', '.join(COMMANDS)} (diffrl --help)", file=sys.stderr, flush=True)
        return 2
    train_help = bool(argv) and argv[0] == "train" and any(a in ("-h", "--help") for a in argv)
    if not argv or argv[0] not in COMMANDS or train_help:
        _help_parser().parse_args(argv)  # prints the help or the usage error and exits
        return 2
    if argv[0] == "train":
        argv = _cfg_first(argv)
    return importlib.import_module(RUNNER).main(argv)


if __name__ == "__main__":
    sys.exit(main())
