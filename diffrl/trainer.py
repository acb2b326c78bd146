"""The RL loop: ask the algorithm what to sample → rollout → reward → algorithm.update → weight sync → log →
checkpoint.

One process drives a group of ``ActorRolloutRefWorker`` (actor, rollout and reference on one module; one
rank in-process or one Ray actor per rank). Each step draws ``prompts_per_step`` prompts (a seeded
permutation per pass over the prompt set), samples ``group_size`` trajectories per prompt with per-sample
seeds (``diffrl.sampling.seeding``), scores them and hands them to the algorithm (``diffrl.algorithms``:
the class registered under ``algorithm.trainer``), which turns rewards into its update. Evaluations
(before the first step, every ``eval_every`` steps and after the last) sample fixed held-out seeds with the
ODE and report the rewards and the gold metric. With ``trainer.rollout_replicas`` the training rollouts come
from replicas beside the actor ranks (``diffrl.distributed.rollout``), synced after every step and sent up to
``trainer.max_staleness`` steps ahead of the update (docs/scaling.md, "Rollout replicas").

A run folder holds ``config.yaml``, ``metrics.jsonl`` (one line per step and per evaluation),
``images/eval_step_<N>.png`` and ``.jsonl`` (grid and per-sample scores), ``checkpoints/step_<N>/``,
``wandb/`` (unless ``trainer.wandb=disabled``; see ``diffrl.logging``) and, when the run completes,
``summary.json``.
"""

from __future__ import annotations

import copy
import errno
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from diffrl import checkpoint
from diffrl.algorithms import Algorithm, RunContext, build_algorithm
from diffrl.config import eval_metric_names
from diffrl.data import check_edit_prompts, eval_subset, run_prompts, sample_metadata, step_prompts
from diffrl.distributed import WorkerGroup, WorkerLostError, build_worker_group
from diffrl.distributed.rollout import RolloutReplicas
from diffrl.distributed.workers import ActorRolloutRefWorker, WorkerConfig
from diffrl.logging import Progress, RunLogger
from diffrl.recipes import Config, check_algorithm, check_sizes, to_config, validate
from diffrl.resume import checkpoint_path, cut_records, fingerprint, pick_checkpoint, set_aside
from diffrl.rollout_driver import RolloutDriver
from diffrl.run_report import run_summary, throughput
from diffrl.sampling.distribution import build_feature_space
from diffrl.sampling.evaluation import eval_prompts_and_seeds, read_jsonl
from diffrl.sampling.evaluator import Evaluator
from diffrl.sampling.request import sample_batch
from diffrl.sampling.schedules import TrainingWindow
from diffrl.sampling.seeding import Stream, derive
from diffrl.selection import Selection
from pipelines.base import split_prompts
from rewards.base import RewardError, build_reward


class RunStopped(RuntimeError):
    """The run stopped on a fault; the message names the cause and the checkpoint ``trainer.resume=auto`` continues from."""


def build_window(cfg: Config) -> TrainingWindow:
    s = cfg.sampler
    window_range = list(s.window_range) or [0, s.num_steps]
    if len(window_range) != 2:
        raise ValueError(f"sampler.window_range must be [start, end), got {window_range}")
    return TrainingWindow(
        s.window, s.num_steps, seed=cfg.trainer.seed, timestep_fraction=s.timestep_fraction, size=s.window_size,
        range_start=window_range[0], range_end=window_range[1], shift=s.window_shift, shift_every=s.window_shift_every,
        frozen=s.window_frozen,
    )


def rollout_request(cfg: Config, algorithm: Algorithm, step_prompts: list, masks, step: int) -> TensorDict:
    """RL step ``step``'s rollout request: per-sample seeds (stream ``ROLLOUT``), groups of
    ``trainer.group_size``, the prompts and the algorithm's :class:`~diffrl.algorithms.RolloutPlan` (for the
    window's ``masks``) as non-tensor flags."""
    t = cfg.trainer
    prompts, sources = split_prompts(step_prompts)
    G = t.group_size
    request = algorithm.rollout_plan(masks).request(int(cfg.sampler.micro_batch_size) if cfg.sampler.micro_batch_size else None)
    return sample_batch(
        [p for p in prompts for _ in range(G)], [derive(t.seed, Stream.ROLLOUT, step, j, s) for j in range(len(prompts)) for s in range(G)], request,
        group_id=torch.arange(len(prompts)).repeat_interleave(G), source_images=None if sources is None else sources.repeat_interleave(G, dim=0),
        init_seeds=[derive(t.seed, Stream.INITIAL_NOISE, step, j) for j in range(len(prompts)) for _ in range(G)] if cfg.sampler.same_initial_noise else None,
    )


def ema_decay(steps_done: int, decay: float) -> float:
    """``trainer.ema``'s decay after ``steps_done`` RL steps: ``min((1 + s)/(10 + s), decay)`` (flow_grpo's EMA warm-up)."""
    return min((1.0 + steps_done) / (10.0 + steps_done), float(decay))


def run_context(cfg: Config) -> RunContext:
    names, weights = list(cfg.reward.names), list(cfg.reward.weights) or [1.0] * len(cfg.reward.names)
    if not names:
        raise ValueError("reward.names is empty: give at least one reward")
    if len(weights) != len(names):
        raise ValueError(f"reward.weights has {len(weights)} entries for {len(names)} reward.names; give one weight per reward")
    t = cfg.trainer
    return RunContext(seed=int(t.seed), prompts_per_step=int(t.prompts_per_step), group_size=int(t.group_size), sampler=cfg.sampler,
                      reward_weights={n: float(w) for n, w in zip(names, weights)})


def worker_config(cfg: Config | DictConfig, algorithm: Algorithm | None = None) -> WorkerConfig:
    """What every worker builds its model and engine from: the components' configs as they are."""
    cfg = to_config(cfg)
    algorithm = algorithm or build_algorithm(cfg.algorithm, run_context(cfg))
    return WorkerConfig(
        model=cfg.model, sampler=cfg.sampler, optim=algorithm.config, micro_batch_size=cfg.algorithm.micro_batch_size, seed=int(cfg.trainer.seed),
        old_policy=algorithm.needs_old_policy, total_steps=int(cfg.trainer.steps) * algorithm.optimizer_steps_per_rl_step(),
    )


class Trainer:
    """Runs one recipe (a composed config from ``diffrl.recipes.compose``, or the ``Config`` dataclasses)."""

    def __init__(self, cfg: Config | DictConfig):
        self.cfg = cfg = validate(cfg)  # every value checked before anything is built
        t = cfg.trainer
        if t.threads:
            torch.set_num_threads(int(t.threads))
        check_sizes(cfg)
        self.output_dir = Path(t.output_dir or f"outputs/{cfg.experiment}-{datetime.now():%Y%m%d-%H%M%S}")
        run = run_context(cfg)
        self.algorithm = build_algorithm(cfg.algorithm, run)
        self.algorithm.validate(int(t.num_workers))
        self.low_precision_rollouts = check_algorithm(cfg, self.algorithm)  # FP8 rollouts: another behaviour policy, corrected
        self.resume_path, self.damaged, self.notices = None, [], []
        self.restart_from_scratch = False
        metrics = self.output_dir / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size:  # (an empty one: the run stopped before its first evaluation finished)
            self.resume_path, self.damaged = self._pick_checkpoint()
            self.restart_from_scratch = self.resume_path is None
        torch.manual_seed(t.seed)
        self.window = build_window(cfg)
        self.prompts, self.eval_prompts, self.prompt_metadata = run_prompts(t)
        if self.prompts is not None:
            self.prompts = check_edit_prompts(self.prompts, cfg.model.family, cfg.sampler)
            self.eval_prompts = check_edit_prompts(self.eval_prompts, cfg.model.family, cfg.sampler)
        options = cfg.reward.options  # rewards before the model: a reward that cannot be built (a server down) costs nothing
        self.rewards = {name: (build_reward(name, **options.get(name, {})), w) for name, w in run.reward_weights.items()}
        self.eval_metrics = {name: fn for name, (fn, _) in self.rewards.items()}
        self.gold_name = cfg.reward.gold
        for name in eval_metric_names(cfg.reward):
            if name not in self.eval_metrics:
                self.eval_metrics[name] = build_reward(name, **options.get(name, {}))
        self.judge_names = [name for name in cfg.reward.judges if name != self.gold_name]
        space = cfg.reward.feature_space
        self.feature_space = build_feature_space(space, options.get(space, {})) if space else None
        self._build_workers()
        if self.prompts is None:
            self.prompts = self.workers.default_prompts()
            if self.prompts:
                self.prompts = check_edit_prompts(self.prompts, cfg.model.family, cfg.sampler)
            self.eval_prompts = eval_subset(self.prompts, t)
        if not self.prompts:
            raise ValueError(f"model family {cfg.model.family!r} has no built-in prompts; set trainer.prompts=<file>")

    def _build_workers(self) -> None:
        t = self.cfg.trainer
        config = worker_config(self.cfg, self.algorithm)
        self.workers: WorkerGroup = build_worker_group(
            ActorRolloutRefWorker, config, backend=t.backend, num_workers=t.num_workers,
            **({"num_cpus_per_worker": t.num_cpus_per_worker, "num_gpus_per_worker": t.num_gpus_per_worker, "threads": t.threads, "address": t.ray_address,
                "rendezvous_timeout_s": t.ray_rendezvous_timeout_s, "call_timeout_s": t.ray_call_timeout_s} if t.backend == "ray" else {}),
        )
        self.workers.init_model()
        self.replicas: RolloutReplicas | None = None
        if t.rollout_replicas:
            try:
                self.replicas = RolloutReplicas(
                    config, self.workers, replicas=int(t.rollout_replicas), bucket_bytes=int(t.weight_sync_bucket_mb * 2**20), backend=t.weight_sync_backend,
                    num_cpus=t.num_cpus_per_rollout, num_gpus=t.num_gpus_per_rollout, threads=t.threads, rendezvous_timeout_s=t.ray_rendezvous_timeout_s,
                    call_timeout_s=t.ray_call_timeout_s,
                )
            except BaseException:
                self.workers.shutdown()
                raise
        self.workers.set_loss_fn(self.algorithm.objective())
        self.driver = RolloutDriver(self.cfg, self.algorithm, self.workers, self.replicas, self.rewards, self.prompt_metadata, self.rollout_request,
                                    self.low_precision_rollouts)
        self.flops = self.workers.flops_counter(t.peak_flops)
        self.algorithm.setup(self.workers)

    def _shutdown_workers(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()
        self.workers.shutdown()

    def _pick_checkpoint(self, resume: bool | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
        """:func:`diffrl.resume.pick_checkpoint` for this run (``resume``: None follows ``trainer.resume``)."""
        auto = self.cfg.trainer.resume == "auto" if resume is None else resume
        return pick_checkpoint(self.output_dir, self.cfg, self.algorithm, auto, self.notices)

    # -- pieces ---------------------------------------------------------------------------------
    def step_prompts(self, step: int) -> list[str]:
        """The step's prompts (``diffrl.data.step_prompts``)."""
        return step_prompts(self.prompts, step, self.cfg.trainer.prompts_per_step, self.cfg.trainer.seed)

    def rollout_request(self, step: int) -> TensorDict:
        """The step's rollout request (:func:`rollout_request`)."""
        return rollout_request(self.cfg, self.algorithm, self.step_prompts(step), self._window_masks(step), step)

    def _window_masks(self, step: int):
        """The training window's masks of RL step ``step``; a step ahead of the window (an off-policy rollout
        sent early) gets them from a copy advanced to it (the window moves deterministically)."""
        window = self.window
        if step > window.count:
            window = copy.deepcopy(window)
            for _ in range(step - window.count):
                window.advance()
        return window.masks(step)

    def evaluate(self, step: int) -> dict:
        """Deterministic samples of the held-out (prompt, seed) pairs, scored by every eval metric."""
        t, s = self.cfg.trainer, self.cfg.sampler
        records, seeds = eval_prompts_and_seeds(self.eval_prompts, t.eval_seeds_per_prompt, t.eval_seed)
        evaluator = Evaluator(self.eval_metrics, eval_num_steps=s.eval_num_steps, micro_batch_size=s.micro_batch_size, distribution=True,
                              feature_space=self.feature_space)
        metadata = sample_metadata(split_prompts(records)[0], self.prompt_metadata, step=step)
        result = evaluator.run(self.workers.generate_sequences, records, seeds, policy="ema" if t.ema else "current", metadata=metadata)
        self.logger.log_eval_samples(step, result.images, result.prompts, seeds, result.scores, samples_per_prompt=t.eval_seeds_per_prompt,
                                     max_grid_images=t.max_grid_images, source_images=result.sources)
        return result.metrics

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
                self.resume_path, self.damaged = self._pick_checkpoint(resume=True)
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

    def _evaluate_or_stop(self, done: int, wall_start: float, progress: Progress) -> dict:
        try:
            metrics = self.evaluate(done)
        except RewardError as exc:
            raise self._stop_with_checkpoint(done, f"evaluation at step {done}: {exc}") from None
        self.logger.log({"step": done, "kind": "eval", **metrics, "wall_seconds": time.perf_counter() - wall_start})
        progress.write(f"eval at step {done}: {self._eval_line(metrics)}")
        return metrics

    def _fit(self, wall_start: float) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        (self.output_dir / "images").mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        if self.restart_from_scratch:
            (self.output_dir / "metrics.jsonl").unlink(missing_ok=True)
            self.restart_from_scratch = False
        start_step, before, last_eval = self._resume() if self.resume_path else (0, None, None)
        self.selection, self.stopped_early = Selection(t.select_by, int(t.stop_when_diverging), {n: w for n, (_, w) in self.rewards.items()}), None
        if start_step:  # a resume replays the evaluations it keeps: the same best and the same history
            for record in read_jsonl(self.output_dir / "metrics.jsonl"):
                if record.get("kind") == "eval":
                    self.selection.observe(record["step"], record)
        log = self.logger = RunLogger(
            self.output_dir, wandb_mode=t.wandb, project=t.wandb_project, entity=t.wandb_entity, run_name=t.wandb_run_name,
            config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), max_table_rows=t.max_grid_images,
        )
        progress = Progress(t.steps, initial=start_step, enabled=t.progress, desc=cfg.experiment)
        finished = False
        try:
            for notice in self.notices:
                progress.write(notice)
            self.notices = []
            if before is None:
                if t.ema:  # the EMA starts at the initial weights
                    self.workers.copy_adapter("default", "ema")
                before = self.evaluate(0)
                log.log({"step": 0, "kind": "eval", **before, "wall_seconds": time.perf_counter() - wall_start})
                progress.write(f"eval before training: {self._eval_line(before)}")
                last_eval = before
                self._select(0, before, progress)
            else:
                progress.write(f"resumed from {self.resume_path} at step {start_step}")
                if t.ema and "ema" not in checkpoint.checkpoint_adapters(self.resume_path):
                    self.workers.copy_adapter("default", "ema")
                    progress.write("trainer.ema: the checkpoint holds no EMA (it was trained without trainer.ema); the EMA starts from its weights")
                if last_eval is None:
                    last_eval = self._evaluate_or_stop(start_step, wall_start, progress)
                    self._select(start_step, last_eval, progress)
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
                done = step + 1
                if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                    last_eval = self._evaluate_or_stop(done, wall_start, progress)
                    if self._select(done, last_eval, progress):
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
        summary = self._summary(before, last_eval, time.perf_counter() - wall_start)
        checkpoint.write_json_atomic(self.output_dir / "summary.json", summary)
        return summary

    def _save_checkpoint(self, step: int) -> Path:
        """The checkpoint at ``step`` (written unless it exists: a selected step is also a periodic one)."""
        path = checkpoint_path(self.output_dir, step)
        if path.is_dir():
            return path
        return Path(self.workers.save_checkpoint(self.output_dir / "checkpoints", global_step=step, extra_state=self.trainer_state()))

    def _select(self, step: int, metrics: dict, progress: Progress) -> bool:
        """``trainer.select_by`` and ``trainer.stop_when_diverging`` after the evaluation at ``step``
        (:mod:`diffrl.selection`): a new best writes its checkpoint and ``best.json``; the hacking signature writes the
        step's checkpoint and ends the run (returns True) with a line naming the checkpoint to use."""
        try:
            improved, diverging = self.selection.observe(step, metrics)
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        if improved:
            path = self._save_checkpoint(step) if step > 0 else None
            best = {**self.selection.best, "checkpoint": str(path) if path else None}
            checkpoint.write_json_atomic(self.output_dir / "best.json", best)
        if not diverging:
            return False
        self._save_checkpoint(step)
        best = self.selection.best
        path = checkpoint_path(self.output_dir, best["step"])
        self.stopped_early = {"step": step, "reason": self.selection.stop_message(), "best_step": best["step"], "best_value": best["value"],
                              "checkpoint": str(path) if path else None}
        progress.write(self.selection.stop_message())
        return True

    def close(self) -> None:
        """Release the workers (Ray actors) and the rollout replicas."""
        self._shutdown_workers()

    def _resume(self) -> tuple[int, dict, dict | None]:
        """Load the newest complete checkpoint and cut ``metrics.jsonl`` back to its step (:mod:`diffrl.resume`).

        Restores the trained weights, the optimizer, the old policy, the window and the advantage stat
        tracker; prompts and noise are functions of ``(seed, step)``, so the run continues exactly.
        """
        set_aside(self.output_dir, self.damaged, self.notices)
        state = self.workers.load_checkpoint(self.resume_path, hashes=False)  # _pick_checkpoint hashed it already
        step = int(state["global_step"])
        self.window.load_state_dict(state["window"])
        self.algorithm.load_state_dict(state)
        self.workers.update_weights(step)
        t = self.cfg.trainer
        before, last = cut_records(self.output_dir, step, int(t.eval_every or 0), int(t.steps))
        return step, before, last

    def train_step(self, step: int) -> dict:
        times = {}
        record = {"step": step + 1, "kind": "train"}
        traj = scores = None
        if self.algorithm.needs_rollout(step):
            traj, scores, rollout_record = self.driver.rollouts(step, times)
            record.update(rollout_record)
        start = time.perf_counter()
        result = self.algorithm.update(self.workers, traj, scores, step)
        t = self.cfg.trainer
        if t.ema and (step + 1) % t.ema_every == 0:
            record["ema_decay"] = ema_decay(step + 1, t.ema_decay)
            self.workers.ema_update_adapter("default", "ema", record["ema_decay"])
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
        return throughput(self.cfg, self.algorithm, self.flops, int(self.window.masks(0).trained.sum()), W,
                          self.replicas.replicas if self.replicas is not None else W, record, times)

    def trainer_state(self) -> dict:
        """JSON state saved next to the weights: what a resume needs beyond the engine."""
        return {"experiment": self.cfg.experiment, "fingerprint": fingerprint(self.cfg, self.algorithm), "window": self.window.state_dict(), **self.algorithm.state_dict()}

    @staticmethod
    def _eval_line(metrics: dict) -> str:
        return ", ".join(f"{k[5:]}={v:.4f}" for k, v in metrics.items() if k != "eval/seconds")

    def _summary(self, before: dict, after: dict, wall: float) -> dict:
        """``summary.json`` (:func:`diffrl.run_report.run_summary`)."""
        best = self.selection.best
        selected = None if best is None else {**best, "checkpoint": str(p) if (p := checkpoint_path(self.output_dir, best["step"])) else None}
        steps = self.stopped_early["step"] if self.stopped_early else int(self.cfg.trainer.steps)
        return run_summary(self.cfg, self.output_dir, {name: w for name, (_, w) in self.rewards.items()}, list(self.eval_metrics), self.gold_name,
                           self.judge_names, before, after, wall, steps, selected=selected, stopped_early=self.stopped_early,
                           fidelity_name=self.cfg.reward.fidelity)
