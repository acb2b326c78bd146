"""The evaluations' config checks (``eval.*`` against ``reward.*``), run by ``diffrl.recipes.validate`` before anything
is built: ``eval.select_by`` names an evaluation metric, and ``eval.stop_when_diverging`` has a held-out judge to watch."""

from __future__ import annotations

from diffrl.config import ConfigError, EvalConfig, RewardConfig, eval_metric_names
from diffrl.selection import metric_key


def validate_evaluation(e: EvalConfig, r: RewardConfig) -> None:
    """Raise a one-line :class:`~diffrl.config.ConfigError` naming the ``eval.*`` key, its value and what is valid."""
    if e.select_by is not None:
        key, _ = metric_key(e.select_by)
        if key[len("eval/"):] not in eval_metric_names(r) and not e.select_by.lstrip("-+").startswith("eval/"):
            judges = ", ".join([*([r.gold] if r.gold else []), *r.judges]) or "none: set reward.gold or reward.judges"
            raise ConfigError(f"eval.select_by={e.select_by} names no evaluation metric: use a held-out judge ({judges}) "
                              "or an eval/ key of metrics.jsonl (a leading - selects the lowest)")
        if key[len("eval/"):] in r.names and bool(e.stop_when_diverging) is not False:
            raise ConfigError(f"eval.stop_when_diverging={e.stop_when_diverging} compares the reward with eval.select_by={e.select_by}, which is the "
                              "reward itself; select by a judge the run does not train on")
    if e.stop_when_diverging and e.select_by is None:
        raise ConfigError(f"eval.stop_when_diverging={e.stop_when_diverging} needs eval.select_by=<a held-out judge> (what must not fall while the reward rises)")


__all__ = ["validate_evaluation"]
