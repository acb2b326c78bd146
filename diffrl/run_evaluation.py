"""A run's evaluations (``eval.*``): before the first step, every ``eval.every`` steps and after the last, deterministic
samples of the held-out (prompt, seed) pairs (``diffrl.sampling.evaluator.Evaluator``) scored by the rewards, the gold
metric, the judges and the fidelity metric; the EMA they evaluate (``eval.ema``); the checkpoint kept and the early stop
decided by them (``eval.select_by``, ``eval.stop_when_diverging``: :mod:`diffrl.selection`); and ``summary.json``
(:func:`diffrl.run_report.run_summary`) from the first and last of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from diffrl import checkpoint
from diffrl.config import EvalConfig, SamplerConfig
from diffrl.data import sample_metadata
from diffrl.distributed import WorkerGroup
from diffrl.logging import Progress, RunLogger
from diffrl.recipes import Config
from diffrl.resume import checkpoint_path
from diffrl.run_report import run_summary
from diffrl.run_rewards import RunRewards
from diffrl.sampling.evaluation import eval_prompts_and_seeds, read_jsonl
from diffrl.sampling.evaluator import Evaluator
from diffrl.selection import Selection
from pipelines.base import split_prompts


def ema_decay(steps_done: int, decay: float) -> float:
    """``eval.ema``'s decay after ``steps_done`` steps (RL or optimizer steps, ``eval.ema_cadence``):
    ``min((1 + s)/(10 + s), decay)`` (flow_grpo's EMA warm-up)."""
    return min((1.0 + steps_done) / (10.0 + steps_done), float(decay))


def optimizer_step_ema_plan(first_step: int, num_steps: int, every: int, decay: float, repeats: int) -> list[list[float]]:
    """The EMA moves of ``eval.ema_cadence=optimizer_step`` for ``num_steps`` optimizer steps, the first of them being
    step ``first_step + 1`` of the run: one list of decays per optimizer step, applied in order right after it.

    flow_grpo's ``EMAModuleWrapper.step(params, n)`` with ``n`` the optimizer steps done moves when
    ``(n + 1) % every == 0`` with decay ``min((1 + n)/(10 + n), decay)``; its caller runs once per per-GPU micro-batch, so
    each such ``n`` moves ``repeats`` (= its gradient accumulation steps) times at the weights of optimizer step ``n``.
    """
    plan = []
    for n in range(first_step + 1, first_step + num_steps + 1):
        plan.append([ema_decay(n, decay)] * repeats if (n + 1) % every == 0 else [])
    return plan


class EmaAfterOptimizerSteps:
    """The worker group as the algorithm's update sees it under ``eval.ema_cadence=optimizer_step``: ``update_actor``
    hands the workers, as the control flag ``ema_decays``, the EMA moves to make right after each of its optimizer steps
    (:func:`optimizer_step_ema_plan`); every other call goes to the group unchanged."""

    def __init__(self, workers: WorkerGroup, evaluation: "RunEvaluation"):
        self._workers, self._evaluation = workers, evaluation

    def __getattr__(self, name: str):
        return getattr(self._workers, name)

    def update_actor(self, data):
        keys = data.keys()
        if "update_seeds" in keys:
            num_steps = len(data.get_non_tensor("update_seeds"))
        elif "mini_batch_size" in keys:
            num_steps = data.shape[0] // (int(data.get_non_tensor("mini_batch_size")) * self._workers.dp_size)
        else:
            num_steps = 1
        data.set_non_tensor("ema_decays", self._evaluation.plan_optimizer_steps(num_steps))
        return self._workers.update_actor(data)


def eval_line(metrics: dict) -> str:
    """An evaluation's metrics on one line of the progress output (``eval/`` dropped, wall time left out)."""
    return ", ".join(f"{k[5:]}={v:.4f}" for k, v in metrics.items() if k != "eval/seconds")


class RunEvaluation:
    """The evaluations of one run.

    Args:
        evaluation: the run's ``EvalConfig`` (``eval.*``).
        sampler: the run's ``SamplerConfig`` (the evaluation sampler: ``eval_num_steps``, ``micro_batch_size``).
        steps: ``trainer.steps`` (an evaluation follows the last step).
        rewards: the run's rewards (:class:`~diffrl.run_rewards.RunRewards`): the trained ones with their weights, every
            evaluation metric (the gold metric, the judges, the fidelity metric) and the feature space.
        prompt_metadata: the prompt set's per-prompt rows (the rewards' metadata).

    ``prompts`` (the held-out prompts) is set by the trainer once they are known (a family's built-in prompts come
    with its workers).
    """

    def __init__(self, evaluation: EvalConfig, sampler: SamplerConfig, steps: int, rewards: RunRewards, prompt_metadata: dict):
        self.eval, self.sampler, self.steps, self.prompt_metadata = evaluation, sampler, int(steps), prompt_metadata
        self.weights, self.metrics, self.feature_space = rewards.weights, rewards.metrics, rewards.feature_space
        self.gold_name, self.judge_names, self.fidelity_name = rewards.gold_name, rewards.judge_names, rewards.fidelity_name
        self.prompts: list | None = None
        self.selection: Selection | None = None
        self.stopped_early: dict | None = None
        self.optimizer_steps = 0
        """optimizer steps of the run so far (the EMA of ``eval.ema_cadence=optimizer_step`` counts them)"""
        self._ema_moves: list[float] = []

    def due(self, done: int) -> bool:
        """Whether an evaluation follows RL step ``done`` (every ``eval.every`` steps, and after the last)."""
        every = self.eval.every
        return bool(every and done % every == 0) or done == self.steps

    def evaluate(self, workers: WorkerGroup, logger: RunLogger, step: int) -> dict:
        """Deterministic samples of the held-out (prompt, seed) pairs, scored by every eval metric; the grid and the
        per-sample scores go to the run folder (``images/eval_step_<N>``)."""
        e, s = self.eval, self.sampler
        records, seeds = eval_prompts_and_seeds(self.prompts, e.seeds_per_prompt, e.seed)
        evaluator = Evaluator(self.metrics, eval_num_steps=s.eval_num_steps, micro_batch_size=s.micro_batch_size, distribution=True,
                              feature_space=self.feature_space)
        metadata = sample_metadata(split_prompts(records)[0], self.prompt_metadata, step=step)
        result = evaluator.run(workers.generate_sequences, records, seeds, policy="ema" if e.ema else "current", metadata=metadata)
        logger.log_eval_samples(step, result.images, result.prompts, seeds, result.scores, samples_per_prompt=e.seeds_per_prompt,
                                max_grid_images=e.max_grid_images, source_images=result.sources)
        return result.metrics

    # -- the EMA (eval.ema) -----------------------------------------------------------------------
    def start_ema(self, workers: WorkerGroup, resume_path: Path | None, progress: Progress) -> None:
        """The EMA starts at the initial weights, or continues from a resumed checkpoint's (which may hold none)."""
        if not self.eval.ema:
            return
        if resume_path is None:
            workers.copy_adapter("default", "ema")
        elif "ema" not in checkpoint.checkpoint_adapters(resume_path):
            workers.copy_adapter("default", "ema")
            progress.write("eval.ema: the checkpoint holds no EMA (it was trained without eval.ema); the EMA starts from its weights")

    def per_optimizer_step(self) -> bool:
        """Whether the EMA moves inside the update, after optimizer steps (``eval.ema_cadence=optimizer_step``)."""
        return bool(self.eval.ema) and self.eval.ema_cadence == "optimizer_step"

    def update_workers(self, workers: WorkerGroup):
        """The workers to hand the algorithm's update: wrapped so that the EMA moves after its optimizer steps under
        ``eval.ema_cadence=optimizer_step`` (:class:`EmaAfterOptimizerSteps`), else the group itself."""
        return EmaAfterOptimizerSteps(workers, self) if self.per_optimizer_step() else workers

    def plan_optimizer_steps(self, num_steps: int) -> list[list[float]]:
        """The EMA moves after the next ``num_steps`` optimizer steps, which it counts (:func:`optimizer_step_ema_plan`)."""
        e = self.eval
        plan = optimizer_step_ema_plan(self.optimizer_steps, num_steps, int(e.ema_every), float(e.ema_decay), int(e.ema_repeats))
        self.optimizer_steps += num_steps
        self._ema_moves.extend(d for moves in plan for d in moves)
        return plan

    def update_ema(self, workers: WorkerGroup, steps_done: int) -> dict:
        """After RL step ``steps_done``: move the EMA towards the trained LoRA every ``eval.ema_every`` RL steps
        (``eval.ema_repeats`` times); the record's ``ema_decay`` when it moved. Under ``eval.ema_cadence=optimizer_step``
        the moves were made inside the update; the record has the last one's decay and ``ema_moves``."""
        e = self.eval
        if self.per_optimizer_step():
            moves, self._ema_moves = self._ema_moves, []
            return {"ema_decay": moves[-1], "ema_moves": float(len(moves))} if moves else {}
        if not (e.ema and steps_done % e.ema_every == 0):
            return {}
        decay = ema_decay(steps_done, e.ema_decay)
        for _ in range(int(e.ema_repeats)):
            workers.ema_update_adapter("default", "ema", decay)
        return {"ema_decay": decay}

    # -- selection and early stop (eval.select_by, eval.stop_when_diverging) ------------------------
    def start_selection(self, output_dir: Path, start_step: int) -> None:
        """A fresh selection; a resume replays the evaluations it keeps, so it has the same best and the same history."""
        e = self.eval
        self.selection, self.stopped_early = Selection(e.select_by, int(e.stop_when_diverging), self.weights), None
        if start_step:
            for record in read_jsonl(output_dir / "metrics.jsonl"):
                if record.get("kind") == "eval":
                    self.selection.observe(record["step"], record)

    def select(self, output_dir: Path, step: int, metrics: dict, save_checkpoint: Callable[[int], Path], progress: Progress) -> bool:
        """Observe the evaluation at ``step`` (:mod:`diffrl.selection`): a new best writes its checkpoint
        (``save_checkpoint``) and ``best.json``; the hacking signature writes the step's checkpoint and ends the run
        (returns True) with a line naming the checkpoint to use."""
        try:
            improved, diverging = self.selection.observe(step, metrics)
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        if improved:
            path = save_checkpoint(step) if step > 0 else None
            best = {**self.selection.best, "checkpoint": str(path) if path else None}
            checkpoint.write_json_atomic(output_dir / "best.json", best)
        if not diverging:
            return False
        save_checkpoint(step)
        best = self.selection.best
        path = checkpoint_path(output_dir, best["step"])
        self.stopped_early = {"step": step, "reason": self.selection.stop_message(), "best_step": best["step"], "best_value": best["value"],
                              "checkpoint": str(path) if path else None}
        progress.write(self.selection.stop_message())
        return True

    def summary(self, cfg: Config, output_dir: Path, before: dict, after: dict, wall: float) -> dict:
        """``summary.json`` of the run whose config is ``cfg`` (:func:`diffrl.run_report.run_summary`) with the selected
        checkpoint and an early stop."""
        best = self.selection.best
        selected = None if best is None else {**best, "checkpoint": str(p) if (p := checkpoint_path(output_dir, best["step"])) else None}
        steps = self.stopped_early["step"] if self.stopped_early else self.steps
        return run_summary(cfg, output_dir, self.weights, list(self.metrics), self.gold_name, self.judge_names, before, after, wall, steps,
                           selected=selected, stopped_early=self.stopped_early, fidelity_name=self.fidelity_name)


__all__ = ["EmaAfterOptimizerSteps", "RunEvaluation", "ema_decay", "eval_line", "optimizer_step_ema_plan"]
