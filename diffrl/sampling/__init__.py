"""Sampling: SDE/ODE step kinds (``sde``), training windows (``schedules``), batched rollouts (``rollout``),
named seed streams (``seeding``) and the held-out evaluation sampler (``evaluation``)."""
