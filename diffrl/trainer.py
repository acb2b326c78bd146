"""The RL loop: ask the algorithm what to sample → rollout → reward → algorithm.update → weight sync → log →
checkpoint.

One process drives a group of ``ActorRolloutRefWorker`` (actor, rollout and reference on one module; one
rank in-process or one Ray actor per rank: ``distributed.*``, :mod:`diffrl.run_setup`). Each step draws
``prompts_per_step`` prompts (a seeded permutation per pass over the prompt set), samples ``group_size``
trajectories per prompt with per-sample seeds (``diffrl.sampling.seeding``; :mod:`diffrl.rollout_driver`), scores
them and hands them to the algorithm (``diffrl.algorithms``: the class registered under ``algorithm.trainer``),
which turns rewards into its update. Evaluations (before the first step, every ``eval.every`` steps and after the
last; :mod:`diffrl.run_evaluation`) sample fixed held-out seeds with the ODE and report the rewards and the gold
metric. With ``distributed.rollout_replicas`` the training rollouts come from replicas beside the actor ranks
(``diffrl.distributed.rollout``), synced after every step and sent up to ``distributed.max_staleness`` steps
ahead of the update (docs/scaling.md, "Rollout replicas"). Resume: :mod:`diffrl.resume`.

A run folder holds ``config.yaml``, ``metrics.jsonl`` (one line per step and per evaluation),
``images/eval_step_<N>.png`` and ``.jsonl`` (grid and per-sample scores), ``checkpoints/step_<N>/``,
``wandb/`` (unless ``trainer.wandb=disabled``; see ``diffrl.logging``) and, when the run completes,
``summary.json``.
"""

from __future__ import annotations

import errno
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from diffrl import checkpoint
from diffrl.algorithms import Pairs, build_algorithm
from diffrl.config import BatchPlan
from diffrl.data import family_default_prompts, family_prompts, step_prompts
from diffrl.distributed import WorkerLostError
from diffrl.distributed.checks import validate_distributed
from diffrl.logging import Progress, RunLogger
from diffrl.recipes import Config, validate_and_resolve
from diffrl.resume import checkpoint_path, cut_records, fingerprint, pick_checkpoint, set_aside
from diffrl.rollout_driver import RolloutDriver, rollout_request, window_masks
from diffrl.run_evaluation import RunEvaluation, eval_line
from diffrl.run_report import throughput
from diffrl.run_rewards import build_rewards
from diffrl.run_setup import algorithm_context, build_worker_config, build_workers
from diffrl.sampling.schedules import build_window
from rewards.base import RewardError


class RunStopped(RuntimeError):
    """The run stopped on a fault; the message names the cause and the checkpoint ``trainer.resume=auto`` continues from."""


def groups_with_spread(rewards: torch.Tensor, group_id: torch.Tensor) -> float:
    """The fraction of prompt groups whose rewards are not all equal (a group of equal rewards has zero advantages
    under group-relative normalisation, so it teaches nothing)."""
    ids = group_id.unique()
    spread = [bool((rewards[group_id == g].max() - rewards[group_id == g].min()) > 0) for g in ids]
    return sum(spread) / max(1, len(spread))


class Trainer:
    """Runs one recipe (a composed config from ``diffrl.recipes.compose``, or the ``Config`` dataclasses)."""

    def __init__(self, cfg: Config | DictConfig):
        self.cfg, self.parts = cfg, parts = validate_and_resolve(cfg)  # every component's config checked, its family and rewards resolved, before anything is built
        t = cfg.trainer
        if t.threads:
            torch.set_num_threads(int(t.threads))
        self.batch = BatchPlan.of(t, cfg.distributed, cfg.model, cfg.algorithm)  # the batch arithmetic, once
        self.run = run = algorithm_context(t.seed, cfg.sampler, cfg.reward, self.batch)
        self.algorithm = build_algorithm(cfg.algorithm, run)
        # the sizes, then the algorithm against the ranks and rollouts, then the sequence-parallel groups
        validate_distributed(cfg.distributed, self.batch, cfg.model, cfg.sampler, parts.family, async_chunks=int(cfg.reward.async_chunks),
                             ema=bool(cfg.eval.ema), algorithm=self.algorithm)
        self.output_dir = Path(t.output_dir or f"outputs/{cfg.experiment}-{datetime.now():%Y%m%d-%H%M%S}")
        self.fingerprint = fingerprint(cfg.model, t, self.algorithm.name)  # what a checkpoint must share to be resumed
        self.resume_path, self.damaged, self.notices = None, [], []
        self.restart_from_scratch = False
        self._steps_without_spread = 0  # steps in a row whose groups all had equal rewards (trainer.no_spread_warning)
        metrics = self.output_dir / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size:  # (an empty one: the run stopped before its first evaluation finished)
            self.resume_path, self.damaged = pick_checkpoint(self.output_dir, self.fingerprint, t.resume == "auto", self.notices)
            self.restart_from_scratch = self.resume_path is None
        torch.manual_seed(t.seed)
        self.window = build_window(cfg.sampler, t.seed)
        self.prompts, eval_prompts, self.prompt_metadata = family_prompts(t, cfg.eval, cfg.model.family, cfg.sampler, editing=parts.family.editing,
                                                                          offline_pairs=self.algorithm.spec.pairs is Pairs.OFFLINE)
        self.rewards = build_rewards(cfg.reward, parts)  # rewards before the model: a reward that cannot be built (a server down) costs nothing
        self.evaluation = RunEvaluation(cfg.eval, cfg.sampler, t.steps, self.rewards, self.prompt_metadata)
        self._build_workers()
        if self.prompts is None:
            self.prompts, eval_prompts = family_default_prompts(self.workers.default_prompts(), cfg.eval, cfg.model.family, cfg.sampler,
                                                                editing=parts.family.editing)
        self.evaluation.prompts = eval_prompts
        if not self.prompts:
            raise ValueError(f"model family {cfg.model.family!r} has no built-in prompts; set trainer.prompts=<file>")

    def _build_workers(self) -> None:
        cfg = self.cfg
        config = build_worker_config(cfg.model, cfg.sampler, self.algorithm, seed=cfg.trainer.seed, steps=cfg.trainer.steps)
        self.workers, self.replicas = build_workers(cfg.distributed, config, threads=cfg.trainer.threads)
        self.workers.set_loss_fn(self.algorithm.objective())
        self.driver = RolloutDriver(self.algorithm, self.workers, self.replicas, self.rewards.trained, self.prompt_metadata, self.rollout_request,
                                    steps=int(cfg.trainer.steps), max_staleness=int(cfg.distributed.max_staleness),
                                    async_chunks=int(cfg.reward.async_chunks), rollout_precision=cfg.model.rollout_precision)
        self.flops = self.workers.flops_counter(self.cfg.trainer.peak_flops)
        self.algorithm.setup(self.workers)

    def _shutdown_workers(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()
        self.workers.shutdown()

    def step_prompts(self, step: int) -> list[str]:
        """The step's prompts (``diffrl.data.step_prompts``)."""
        return step_prompts(self.prompts, step, self.batch.prompts_per_step, self.run.seed)

    def rollout_request(self, step: int) -> TensorDict:
        """The step's rollout request (:func:`diffrl.rollout_driver.rollout_request`)."""
        return rollout_request(self.run, self.algorithm, self.step_prompts(step), window_masks(self.window, step), step)

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Run the recipe to ``trainer.steps``; returns the summary (also in ``summary.json``).

        Faults (see ``docs/reliability.md``): a reward that fails after its own retries writes a checkpoint of
        the steps done and stops; a non-finite update is skipped and counted or stops
        (``algorithm.nonfinite``); a full disk stops with the newest checkpoint intact; a lost worker restarts
        the workers from the newest checkpoint up to ``trainer.max_restarts`` times, then stops. A stop raises
        :class:`RunStopped` naming the cause and the checkpoint ``trainer.resume=auto`` continues from.
        """
        t = self.cfg.trainer
        wall_start, restarts = time.perf_counter(), 0
        while True:
            try:
                return self._fit(wall_start)
            except WorkerLostError as exc:
                found = checkpoint.list_checkpoints(self.output_dir / "checkpoints")
                if restarts >= t.max_restarts or not found:
                    why = f"the newest checkpoint is {found[-1].name}" if found else "no checkpoint was written yet"
                    raise RunStopped(f"{exc}; the run stopped ({why}) — continue with trainer.resume=auto, or set trainer.max_restarts to restart lost workers") from None
                restarts += 1
                self.notices = [f"{exc}; restarting the workers from {found[-1].name} (restart {restarts} of {t.max_restarts})"]
                self._shutdown_workers()
                self._build_workers()
                self.resume_path, self.damaged = pick_checkpoint(self.output_dir, self.fingerprint, True, self.notices)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                raise RunStopped(
                    f"no space left writing {exc.filename or 'to the run folder'} ({exc.strerror}); {self._newest_checkpoint_line()} — free space and continue with trainer.resume=auto"
                ) from None

    def _newest_checkpoint_line(self) -> str:
        found = checkpoint.list_checkpoints(self.output_dir / "checkpoints")
        return f"the newest checkpoint {found[-1].name} is intact" if found else "no checkpoint was written yet"

    def _stop_with_checkpoint(self, step: int, cause: str) -> RunStopped:
        """A checkpoint of the ``step`` steps done (unless one exists), and the error that stops the run."""
        root = self.output_dir / "checkpoints"
        path = root / f"step_{step:06d}"
        if not path.exists():
            path = self.workers.save_checkpoint(root, global_step=step, extra_state=self.trainer_state())
        return RunStopped(f"{cause}; the run stopped — checkpoint {Path(path).name} holds the {step} steps done: continue with trainer.resume=auto")

    def _evaluate(self, done: int, wall_start: float, progress: Progress, what: str) -> tuple[dict, bool]:
        """The evaluation after ``done`` steps, logged and observed by the selection (a reward failure after training
        steps stops the run with their checkpoint); returns its metrics and whether the run stops early
        (``eval.stop_when_diverging``)."""
        try:
            metrics = self.evaluation.evaluate(self.workers, self.logger, done)
        except RewardError as exc:
            if not done:  # before training: nothing to keep
                raise
            raise self._stop_with_checkpoint(done, f"evaluation at step {done}: {exc}") from None
        self.logger.log({"step": done, "kind": "eval", **metrics, "wall_seconds": time.perf_counter() - wall_start})
        progress.write(f"{what}: {eval_line(metrics)}")
        return metrics, self.evaluation.select(self.output_dir, done, metrics, self._save_checkpoint, progress)

    def _fit(self, wall_start: float) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        (self.output_dir / "images").mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        if self.restart_from_scratch:
            (self.output_dir / "metrics.jsonl").unlink(missing_ok=True)
            self.restart_from_scratch = False
        start_step, before, last_eval = self._resume() if self.resume_path else (0, None, None)
        self.evaluation.start_selection(self.output_dir, start_step)
        log = self.logger = RunLogger(
            self.output_dir, wandb_mode=t.wandb, project=t.wandb_project, entity=t.wandb_entity, run_name=t.wandb_run_name,
            config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), max_table_rows=cfg.eval.max_grid_images,
        )
        progress = Progress(t.steps, initial=start_step, enabled=t.progress, desc=cfg.experiment)
        finished = False
        try:
            for notice in self.notices:
                progress.write(notice)
            self.notices = []
            if before is None:
                self.evaluation.start_ema(self.workers, None, progress)
                before, _ = self._evaluate(0, wall_start, progress, "eval before training")
                last_eval = before
            else:
                progress.write(f"resumed from {self.resume_path} at step {start_step}")
                self.evaluation.start_ema(self.workers, self.resume_path, progress)
                if last_eval is None:
                    last_eval, _ = self._evaluate(start_step, wall_start, progress, f"eval at step {start_step}")
            self.driver.start(start_step)
            self._initial_sync = None
            if self.replicas is not None:  # the replicas start from the actor's weights (a resume's included)
                self.replicas.discard()
                self._initial_sync = self.replicas.sync(start_step)
            for step in range(start_step, t.steps):
                try:
                    record = self.train_step(step)
                except RewardError as exc:
                    raise self._stop_with_checkpoint(step, f"step {step + 1}: {exc}") from None
                except FloatingPointError as exc:
                    raise RunStopped(f"step {step + 1}: {exc}; the run stopped — {self._newest_checkpoint_line()}: continue with trainer.resume=auto "
                                     "(a lower algorithm.lr, or algorithm.nonfinite=skip)") from None
                record["wall_seconds"] = time.perf_counter() - wall_start
                log.log(record)
                if record.get("skipped_nonfinite"):
                    progress.write(f"step {step + 1}: non-finite loss or gradients: {record['skipped_nonfinite']:g} optimizer step(s) skipped (algorithm.nonfinite=skip)")
                progress.update(reward=record.get("reward_mean", float("nan")), loss=record.get("loss", float("nan")))
                self._warn_without_spread(record, progress)
                done = step + 1
                if self.evaluation.due(done):
                    last_eval, stop = self._evaluate(done, wall_start, progress, f"eval at step {done}")
                    if stop:
                        break
                if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
                    self._save_checkpoint(done)
            finished = True
        finally:
            progress.close()
            try:
                log.close()
            except OSError:
                if finished:  # otherwise the fault that stopped the run is the one to report
                    raise
        summary = self.evaluation.summary(cfg, self.output_dir, before, last_eval, time.perf_counter() - wall_start)
        checkpoint.write_json_atomic(self.output_dir / "summary.json", summary)
        return summary

    def _warn_without_spread(self, record: dict, progress: Progress) -> None:
        """One line, once, when ``trainer.no_spread_warning`` steps in a row had no prompt group with reward spread."""
        n = int(self.cfg.trainer.no_spread_warning or 0)
        if "groups_with_spread" not in record or not n:
            return
        self._steps_without_spread = 0 if record["groups_with_spread"] > 0 else self._steps_without_spread + 1
        if self._steps_without_spread == n:
            progress.write(f"diffrl: warning: step {record['step']}: no prompt group's rewards have differed for {n} steps (every advantage 0, "
                           f"loss {record.get('loss', 0.0):g}, grad norm {record.get('grad_norm', 0.0):g}): nothing learns; check the reward "
                           "(a saturated or constant score), raise trainer.group_size or sampler.noise_level (trainer.no_spread_warning=0 silences this)")

    def _save_checkpoint(self, step: int) -> Path:
        """The checkpoint at ``step`` (written unless it exists: a selected step is also a periodic one)."""
        path = checkpoint_path(self.output_dir, step)
        if path.is_dir():
            return path
        return Path(self.workers.save_checkpoint(self.output_dir / "checkpoints", global_step=step, extra_state=self.trainer_state()))

    def close(self) -> None:
        """Release the workers (Ray actors) and the rollout replicas."""
        self._shutdown_workers()

    def _resume(self) -> tuple[int, dict, dict | None]:
        """Load the newest complete checkpoint and cut ``metrics.jsonl`` back to its step (:mod:`diffrl.resume`).

        Restores the trained weights, the optimizer, the old policy, the window and the advantage stat
        tracker; prompts and noise are functions of ``(seed, step)``, so the run continues exactly.
        """
        set_aside(self.output_dir, self.damaged, self.notices)
        state = self.workers.load_checkpoint(self.resume_path, hashes=False)  # pick_checkpoint hashed it already
        step = int(state["global_step"])
        self.window.load_state_dict(state["window"])
        self.algorithm.load_state_dict(state)
        if self.evaluation.per_optimizer_step():  # the EMA's optimizer-step count (eval.ema_cadence=optimizer_step)
            self.evaluation.optimizer_steps = int(state.get("ema_optimizer_steps", step * self.algorithm.optimizer_steps_per_rl_step()))
        self.workers.update_weights(step)
        before, last = cut_records(self.output_dir, step, int(self.cfg.eval.every or 0), int(self.cfg.trainer.steps))
        return step, before, last

    def train_step(self, step: int) -> dict:
        times = {}
        record = {"step": step + 1, "kind": "train"}
        traj = scores = None
        if self.algorithm.needs_rollout(step):
            traj, scores, rollout_record = self.driver.rollouts(step, times)
            record.update(rollout_record)
            record["groups_with_spread"] = groups_with_spread(scores["rewards"].detach().cpu(), traj["group_id"].cpu())
        start = time.perf_counter()
        result = self.algorithm.update(self.evaluation.update_workers(self.workers), traj, scores, step)
        record.update(self.evaluation.update_ema(self.workers, step + 1))
        self.workers.update_weights(step + 1)
        self.window.advance()
        times["time/train"] = time.perf_counter() - start
        if self.replicas is not None:  # the replicas get version step + 1 (after the requests already sent to them)
            record.update(self.replicas.sync(step + 1))
            if self._initial_sync:
                record.update({f"weight_sync/initial_{k.split('/')[-1]}": v for k, v in self._initial_sync.items() if k.startswith("weight_sync/hash")})
                self._initial_sync = None
        record.update(result.record)
        for key, values in result.metrics.items():
            if isinstance(values, list) and values and isinstance(values[0], (int, float)):
                record[key] = sum(values) if key == "skipped_nonfinite" else sum(values) / len(values)
        if "ratio_mean" in result.metrics:
            record["first_ratio_mean"] = result.metrics["ratio_mean"][0]
        record.update(times)
        record.update(self.throughput(record, times))
        return record

    def rollout_and_score(self, step: int, times: dict) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        """Step ``step``'s trajectories sampled now and scored (:meth:`RolloutDriver.rollout_and_score`)."""
        return self.driver.rollout_and_score(step, times)

    def throughput(self, record: dict, times: dict) -> dict:
        """The step's images/s and MFU (:func:`diffrl.run_report.throughput`)."""
        W = self.workers.world_size
        masks = self.window.masks(0)  # steps each sample trains: its own per_sample of the candidates (DanceGRPO), else all
        trained = masks.per_sample or int(masks.trained.sum())
        return throughput(self.cfg, self.algorithm, self.flops, trained, W,
                          self.replicas.replicas if self.replicas is not None else W, record, times)

    def trainer_state(self) -> dict:
        """JSON state saved next to the weights: what a resume needs beyond the engine."""
        state = {"experiment": self.cfg.experiment, "fingerprint": self.fingerprint, "window": self.window.state_dict(), **self.algorithm.state_dict()}
        if self.evaluation.per_optimizer_step():
            state["ema_optimizer_steps"] = self.evaluation.optimizer_steps
        return state
