"""Shared fixtures: tiny random digits models (seconds on CPU) and the shipped assets."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# pytest-xdist runs one test process per core: each takes one intra-op thread, and so do the processes a test starts
# (notebook kernels, gloo ranks, Ray workers, `diffrl` subprocesses): two processes of two OpenMP threads each on two
# cores run ~10× slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))
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


RAY_LOCAL = dict(address="local", num_cpus=2, include_dashboard=False, object_store_memory=150 * 1024 * 1024, log_to_driver=False)


@pytest.fixture
def ray_local():
    """A local Ray instance of 2 CPUs, started by the first test that asks and kept while the next test of this process
    asks too (``ray.init`` and ``ray.shutdown`` cost ~5 s a test: the Ray phase started six); shut down after the last of
    such a run (:func:`pytest_runtest_teardown`: an idle instance's daemons slowed a one-thread workload beside it by
    20-70 %, and the fast tier by half when it stayed up). After a test whose actors or placement groups still hold CPUs
    (one that failed mid-run, or killed ranks), the instance is shut down too, so the next test starts on a fresh one."""
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_LOCAL)
    yield ray
    if not ray.is_initialized():
        return
    import time

    deadline = time.monotonic() + 5.0  # a killed actor's CPUs come back asynchronously
    while ray.available_resources().get("CPU", 0) < RAY_LOCAL["num_cpus"] and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [pg for pg in ray.util.placement_group_table().values() if pg.get("state") != "REMOVED"]
    if ray.available_resources().get("CPU", 0) < RAY_LOCAL["num_cpus"] or leftover:
        ray.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the local Ray instance (:func:`ray_local`) after a test that used it unless the next one here uses it too."""
    if "ray_local" in getattr(item, "fixturenames", ()) and "ray_local" not in getattr(nextitem, "fixturenames", ()):
        import ray

        if ray.is_initialized():
            ray.shutdown()


def randomise_lora(module: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> None:
    """Give every LoRA B matrix non-zero values so the adapter changes the model's output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


# Tiers. The README's `python -m pytest` runs the fast tier (`-m "not slow"` in pyproject.toml's addopts): unit, parity,
# user-surface, architecture and short learning tests. `pytest -m slow` runs the rest (the default recipe end to end,
# plan vs the H200 measurements, the notebooks, long runs, Ray parity runs); `pytest tests/test_ray_cluster.py -m multinode -n 0` the two-node Ray
# cluster, alone (its `ray stop --force` ends every Ray process on the machine). CI runs all three. `recipe` implies `slow`.
#
# Numerics: every fast test is also a `numerics` test unless its module says `pytestmark = pytest.mark.exact`, or the test
# itself `@pytest.mark.exact` with its reason (it compares no floats computed along different code paths: messages, files,
# configs, processes, a run against itself bit for bit, a score computed by no ATen kernel). CI runs the numerics tests again
# under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU (else default): a tolerance that holds only with one CPU's float32
# kernels then fails in CI, not on a user's machine. A new test module is a numerics module until it says otherwise.
# A slow test that reproduces published numbers says `@pytest.mark.numerics` itself and is rerun too.
# `ranks` tests (gloo or Ray ranks against one process, the costliest fast tests) are left out of that rerun: both
# sides run the same CPU's kernels, and their tolerances bound the ranks' reduction order, not a kernel's.


#
# Scheduling: the `ray` tests and the two-node `multinode` test form one xdist group: under `--dist loadgroup` they run one
# after another on one process (two of them at once, four ranks and two drivers on 2 cores, ran 2-3x slower than alone),
# the two-node test last (its `ray stop --force` ends every Ray process); CI runs them as a phase of their own with -n 0
# instead (beside a learning run, Ray's ranks and daemons slowed both 1.5-3x);
# xdist hands out the largest group first, and the slow tests, longest first by their `seconds=` (learning runs or not),
# come before the short ones, so that no process is left with a 2-minute run at the end while the other idles.


def _xdist_group(config, item, name: str) -> None:
    """Put ``item`` in xdist group ``name``. pytest-xdist 3.8 names an item's group by suffixing ``item._nodeid`` with
    ``@name``, which pytest 9 no longer reads (a node's id lives in ``item._id``): without this the group was silently
    ignored and two Ray tests could run at once; the suffix is set here as xdist means it."""
    item.add_marker(pytest.mark.xdist_group(name))
    if os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup") and not item.nodeid.endswith(f"@{name}"):
        from _pytest.nodeid import coerce_node_id  # pytest 9's node-id type (no public setter)

        item._id = coerce_node_id(f"{item.nodeid}@{name}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("recipe") is not None:
            item.add_marker(pytest.mark.slow)
        if not any(item.get_closest_marker(m) is not None for m in ("slow", "multinode", "exact", "ranks")):
            item.add_marker(pytest.mark.numerics)
        if item.get_closest_marker("ray") is not None or item.get_closest_marker("multinode") is not None:
            _xdist_group(config, item, "ray")

    def order(item) -> tuple[int, float]:
        if item.get_closest_marker("multinode") is not None:
            return 3, 0.0  # last: its `ray stop --force` ends every Ray process, after the group's other tests
        tier = item.get_closest_marker("recipe") or item.get_closest_marker("slow")
        # the slow tier before the fast one and longest first, learning run or not (`seconds=`, its time in CI): worksteal
        # hands each process one half of the list and the idle one takes the other's last tests, so the two end within
        # about the shortest test of each other; ordered by kind (learning runs, then the rest) they had ended ~100 s apart
        return (2, 0.0) if tier is None else (0, -float(tier.kwargs.get("seconds", 0)))

    items.sort(key=order)  # stable: a module's tests keep their order
