"""Picking the checkpoint to use and stopping before the reward is gamed.

A run optimises its reward; a held-out judge (``reward.gold`` or one of ``reward.judges``, never trained on) says
whether the gains are real. Two settings act on the evaluations' history:

* ``eval.select_by=<metric>`` keeps the best checkpoint by that metric: each evaluation that improves on every
  earlier one (the evaluation before training included) writes a checkpoint at its step and ``best.json`` names it.
  ``-<metric>`` selects the lowest value (e.g. a distance).
* ``eval.stop_when_diverging=k`` stops the run when, over the last ``k`` evaluations, the evaluation reward (the
  weighted sum of ``reward.names``, on the held-out prompts) rose every time while the ``select_by`` metric fell every
  time: the reward-hacking signature (reward up, judge down). The stop names the step and the best checkpoint.

Everything here is a pure function of the evaluation records (``metrics.jsonl``'s ``kind: eval`` lines), so a resumed
run replays the same history and reaches the same choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def metric_key(name: str) -> tuple[str, float]:
    """``(eval key, sign)`` of a ``eval.select_by`` value: ``digits_gold2`` → ``("eval/digits_gold2", +1)``,
    ``-eval/frechet_distance`` → ``("eval/frechet_distance", −1)`` (lower is better)."""
    sign = -1.0 if name.startswith("-") else 1.0
    key = name.lstrip("-+")
    return (key if key.startswith("eval/") else f"eval/{key}"), sign


def diverging(rewards: list[float], judge: list[float], k: int) -> bool:
    """Whether the last ``k`` changes of ``rewards`` are all rises while those of ``judge`` (higher is better) are all
    falls. Needs ``k + 1`` evaluations; ``k < 1`` never triggers.

    >>> diverging([0.1, 0.2, 0.3], [0.6, 0.5, 0.4], 2), diverging([0.1, 0.2, 0.3], [0.6, 0.5, 0.55], 2)
    (True, False)
    """
    if k < 1 or len(rewards) < k + 1 or len(judge) < k + 1:
        return False
    r, j = rewards[-(k + 1):], judge[-(k + 1):]
    return all(b > a for a, b in zip(r, r[1:])) and all(b < a for a, b in zip(j, j[1:]))


@dataclass
class Selection:
    """The evaluation history of one run as ``eval.select_by`` / ``eval.stop_when_diverging`` read it.

    Attributes:
        metric: ``eval.select_by`` (``None``: nothing is selected, nothing stops).
        patience: ``eval.stop_when_diverging`` (``k``; 0: never stops).
        reward_weights: reward name → weight: the evaluation reward is ``Σ w · eval/<name>``.
        steps, rewards, judge: one entry per evaluation observed.
        best: ``{"step", "value", "metric"}`` of the best evaluation so far (signed back to the metric's own scale).
    """

    metric: str | None
    patience: int
    reward_weights: dict[str, float]
    steps: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    judge: list[float] = field(default_factory=list)
    best: dict | None = None

    def observe(self, step: int, evals: dict) -> tuple[bool, bool]:
        """Record the evaluation at ``step``; ``(improved, diverging)``: it is the best so far, and the last
        ``patience`` evaluations show the hacking signature."""
        if self.metric is None:
            return False, False
        key, sign = metric_key(self.metric)
        if key not in evals:
            raise KeyError(f"eval.select_by={self.metric}: the evaluation has no {key}; it has {sorted(k for k in evals if k.startswith('eval/'))}")
        value = float(evals[key])
        reward = sum(w * float(evals[f"eval/{name}"]) for name, w in self.reward_weights.items())
        self.steps.append(int(step))
        self.rewards.append(reward)
        self.judge.append(sign * value)
        improved = math.isfinite(value) and (self.best is None or sign * value > sign * self.best["value"])
        if improved:
            self.best = {"step": int(step), "value": value, "metric": key}
        return improved, diverging(self.rewards, self.judge, self.patience)

    def stop_message(self) -> str:
        """Why the run stops: the reward and the judge over the last ``patience`` evaluations, and what to use."""
        k, (key, _) = self.patience, metric_key(self.metric or "")
        first, last = self.steps[-(k + 1)], self.steps[-1]
        sign = -1.0 if (self.metric or "").startswith("-") else 1.0
        judge = [sign * v for v in self.judge[-(k + 1):]]
        use = f"checkpoint step_{self.best['step']:06d}" if self.best and self.best["step"] > 0 else "the base model (no step beat it)"
        return (f"stopped at step {last}: from step {first} the evaluation reward rose at each of the last {k} evaluations "
                f"({self.rewards[-(k + 1)]:.4g} → {self.rewards[-1]:.4g}) while {key} fell ({judge[0]:.4g} → {judge[-1]:.4g}), the reward-hacking "
                f"signature (eval.stop_when_diverging={k}); use {use}, the best by {key}")
