"""Shared fixtures: tiny random digits models (seconds on CPU) and the shipped assets."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Tests never touch the network, and a developer's own Hugging Face cache does not leak into them: Hub ids resolve in an
# empty cache of this session, offline (tests that need a cached model build one in their own HF_HOME, tests/test_hub.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="diffrl-tests-hf-")
os.environ.pop("HF_HUB_CACHE", None)


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: one intra-op thread avoids oversubscription on a shared CPU (and keeps runs fast)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def tiny_adapter():
    """The digits family's tiny random configuration (no weights loaded)."""
    from pipelines.digits import DigitsAdapter

    return DigitsAdapter(path=None, seed=0)


def randomise_lora(module: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    """Give every LoRA B matrix non-zero values so the adapter changes the model's output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


# Modules whose assertions compare floats computed along different code paths (closed forms, parity, invariance,
# means of per-sample values). CI runs them a second time under ATEN_CPU_CAPABILITY=default (and avx2 on an
# AVX-512 machine): a tolerance that holds only with one CPU's kernels then fails in CI, not on a user's machine.
NUMERICS_MODULES = {
    "test_sde", "test_sde_kinds", "test_sde_solvers", "test_losses", "test_losses_algorithms", "test_advantages", "test_awm",
    "test_parity", "test_paired_change", "test_windows", "test_algorithms", "test_reward_plugins", "test_digits_eps", "test_numerics",
    "test_cfg_and_rollout", "test_families", "test_family_qwen_image", "test_family_wan", "test_sd15", "test_flops", "test_workers",
    "test_reward_server", "test_fused_lora", "test_family_wan22", "test_compose_edit_fidelity",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in NUMERICS_MODULES and item.get_closest_marker("recipe") is None:
            item.add_marker(pytest.mark.numerics)
