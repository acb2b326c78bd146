"""The CPU kernels the numerics pass runs on: ``ATEN_CPU_CAPABILITY`` really selects them."""

from __future__ import annotations

import os

import torch

ORDER = ["DEFAULT", "AVX2", "AVX512"]


def test_requested_cpu_capability_is_the_one_in_use():
    """CI reruns the numerics tests with ``ATEN_CPU_CAPABILITY=default`` / ``avx2``; this checks the request took
    effect (torch caps the kernels at the requested level, never above what the CPU has)."""
    requested = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    used = torch.backends.cpu.get_cpu_capability()
    assert used in ORDER + ["VSX", "ZVECTOR", "SVE256", "SVE"], used
    if requested in ORDER and used in ORDER:
        assert ORDER.index(used) <= ORDER.index(requested), (requested, used)
        if requested == "DEFAULT":
            assert used == "DEFAULT"

