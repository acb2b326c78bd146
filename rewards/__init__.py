"""Rewards for diffrl: the protocol and registry (``base.py``) and one file per reward."""

from rewards.base import Reward, RewardError, build_reward, register_reward, resolve_reward, score

__all__ = ["Reward", "RewardError", "build_reward", "register_reward", "resolve_reward", "score"]
