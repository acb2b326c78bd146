"""Ray across machines, on one machine: a head node and a worker node (``--node-ip-address=127.0.0.2``) started
by the test, one rank placed on each, the rendezvous at rank 0's node, the two-rank run equal to the local
run, and a clear error within seconds when the cluster is too small. Only loopback addresses are used."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffrl.distributed.ray import _node_plan
from diffrl.recipes import compose
from diffrl.trainer import Trainer
from test_scale_out import _overrides, _train_records

HEAD, WORKER = "127.0.0.3", "127.0.0.2"  # loopback addresses (127.0.0.1 itself Ray replaces by the machine's address)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _ray(*args: str, env: dict) -> None:
    cmd = [str(Path(sys.executable).with_name("ray")), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


@pytest.fixture
def two_node_cluster(tmp_path, monkeypatch):
    """A Ray head (1 CPU) and a worker node (1 CPU) on loopback addresses; stopped afterwards. Token
    authentication on every node and the driver, with the machine's Ray token (``~/.ray/auth_token``, which any
    local ``ray.init()`` creates too), as a real cluster runs it; this process keeps reading that same token."""
    import ray

    if ray.is_initialized():  # the process's local instance (tests/conftest.py, ray_local): the run must join this cluster
        ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        assert key not in env, f"{key} is set: the test uses the machine's Ray token file"
    _ray("get-auth-token", "--generate", env=env)
    port = _free_port(HEAD)
    common = ["--num-cpus=1", "--num-gpus=0", "--object-store-memory=150000000", "--disable-usage-stats"]
    try:
        _ray("start", "--head", f"--node-ip-address={HEAD}", f"--port={port}", "--include-dashboard=false", *common, env=env)
        _ray("start", f"--address={HEAD}:{port}", f"--node-ip-address={WORKER}", *common, env=env)
        yield f"{HEAD}:{port}"
    finally:
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_node_plan_packs_ranks_node_by_node_and_names_what_is_missing():
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 16.0, "GPU": 8.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 16.0, "GPU": 8.0}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 16.0, "GPU": 8.0}},
    ]
    assert _node_plan(nodes, 16, 1.0, 1.0, driver_ip="10.0.0.1") == [("10.0.0.1", 8), ("10.0.0.2", 8)]
    assert _node_plan(nodes, 10, 1.0, 1.0, driver_ip="10.0.0.9") == [("10.0.0.1", 8), ("10.0.0.2", 2)]
    assert _node_plan(nodes, 4, 4.0, 0.0, driver_ip="10.0.0.2") == [("10.0.0.2", 4)]
    with pytest.raises(RuntimeError, match=r"num_workers=17 .*room for 16 .*1 more rank\(s\) need 1 CPU and 1 GPU"):
        _node_plan(nodes, 17, 1.0, 1.0, driver_ip="10.0.0.1")


@pytest.mark.multinode  # `ray stop --force` at its end stops every Ray process on the machine: run alone (pytest tests/test_ray_cluster.py -m multinode -n 0)
def test_two_nodes_one_rank_each_rendezvous_at_rank0_and_match_the_local_run(tmp_path, two_node_cluster):
    import ray

    local = Trainer(compose(_overrides(tmp_path, tmp_path / "local")))
    local.fit()
    expected = local.workers.trainable_state()

    # a cluster too small for the request fails within seconds, naming what is missing, before any work
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"cannot hold distributed.num_workers=4 .*room for 2 .*2 more rank\(s\) need 2 CPU"):
        Trainer(compose(_overrides(tmp_path, tmp_path / "too_many", "distributed.backend=ray", "distributed.num_workers=4", f"distributed.ray_address={two_node_cluster}")))
    assert time.perf_counter() - start < 60
    assert not ray.is_initialized() and not (tmp_path / "too_many").exists()

    distributed = Trainer(compose(_overrides(tmp_path, tmp_path / "ray", "distributed.backend=ray", "distributed.num_workers=2",
                                             f"distributed.ray_address={two_node_cluster}", "distributed.ray_call_timeout_s=600")))
    try:
        executor = distributed.workers.executor
        assert executor.rank_nodes == [HEAD, WORKER]  # one rank on each node, the driver's node first
        rank0_node = ray.get(executor.actors[0].node_address.remote())[0]
        rank1_node = ray.get(executor.actors[1].node_address.remote())[0]
        assert (rank0_node, rank1_node) == (HEAD, WORKER)
        assert executor.master_addr == rank0_node  # the rendezvous is rank 0's node, not the driver's loopback
        distributed.fit()
        got = distributed.workers.trainable_state()
        # a call that outlives its timeout names the ranks that did not answer and their nodes
        slow = ray.remote(num_cpus=0)(_sleep)
        with pytest.raises(TimeoutError, match=rf"worker call x did not finish within 0.2 s: no answer from rank 0 on {HEAD}, rank 1 on {WORKER}"):
            executor._get([slow.remote(5), slow.remote(5)], "worker call x", 0.2)
    finally:
        distributed.close()
    assert not ray.is_initialized()
    assert got.keys() == expected.keys() and expected
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=2e-6)
    for ra, rb in zip(_train_records(tmp_path / "local"), _train_records(tmp_path / "ray"), strict=True):
        for key in ra:
            if isinstance(ra[key], float) and key != "ratio_std":  # ratio_std: a per-rank std averaged over ranks
                assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key
