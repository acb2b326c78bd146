"""One Ray actor per rank, on one machine or across a cluster: each joins a torch.distributed group (NCCL on
GPU, gloo on CPU) and shards the denoiser with FSDP2; the driver dispatches registered methods to all of them.

Placement: the ranks are packed node by node (one ``STRICT_PACK`` placement group per node, pinned to it by
its ``node:<ip>`` resource; nodes in turn, the driver's first), so rank order follows the hardware and each
node's ranks are contiguous. A cluster with too few CPUs/GPUs is an error within seconds, naming what is
missing. Rendezvous the way torchrun does it: rank 0's actor reports its node's address and a free port on
*that* node, and every rank joins there. Rendezvous and worker calls have timeouts whose errors name the
ranks and nodes that did not answer.
"""

from __future__ import annotations

import math
import os
import socket
import time

import torch

from diffrl.distributed.controller import Executor, WorkerLostError
from diffrl.engine import parallel


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankWorker:
    """The Ray actor body: a process-group member holding one worker of ``worker_cls``."""

    def __init__(self, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.worker = None
        self.backend = None

    def node_address(self) -> tuple[str, int]:
        """This actor's node address and a free port on it (rank 0's are the rendezvous point)."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def setup(self, worker_cls: type, config, role: str, rank: int, world_size: int, master_addr: str, master_port: int,
              backend: str | None, timeout_s: float | None, process_group: bool = True) -> str | None:
        if process_group:
            self.backend = parallel.init_distributed(rank, world_size, master_addr, master_port, backend, timeout_s)
        self.worker = worker_cls(config, role=role)
        return self.backend

    def pid(self) -> int:
        """This rank's process id (for operators and fault-injection tests)."""
        return os.getpid()

    def execute(self, method: str, args: tuple, kwargs: dict):
        return getattr(self.worker, method)(*args, **kwargs)


class ClusterCapacityError(ValueError, RuntimeError):
    """The Ray cluster cannot hold the ranks asked for (``distributed.num_workers`` × the resources of each): bad input,
    found before any work, so the CLI prints it as one line with exit status 2 (a ``ValueError``; also a
    ``RuntimeError``, as it was before it had its own class)."""


def _node_plan(nodes: list[dict], num_workers: int, cpus: float, gpus: float, driver_ip: str,
               keys: tuple[str, str] = ("distributed.num_workers", "distributed.num_cpus_per_worker")) -> list[tuple[str, int]]:
    """``[(node ip, ranks)]``: ranks packed node by node (the driver's node first, then by address).

    Raises:
        ClusterCapacityError: naming the capacity and what is missing when the nodes cannot hold ``num_workers``.
    """
    alive = sorted((n for n in nodes if n.get("Alive")), key=lambda n: (n["NodeManagerAddress"] != driver_ip, n["NodeManagerAddress"]))
    plan, left, described = [], num_workers, []
    for node in alive:
        res = node.get("Resources", {})
        fits = math.floor(res.get("CPU", 0) / cpus + 1e-9) if cpus > 0 else num_workers
        if gpus > 0:
            fits = min(fits, math.floor(res.get("GPU", 0) / gpus + 1e-9))
        described.append(f"{node['NodeManagerAddress']}: {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU → {fits}")
        take = min(fits, left)
        if take > 0:
            plan.append((node["NodeManagerAddress"], take))
            left -= take
    if left > 0:
        raise ClusterCapacityError(
            f"the Ray cluster cannot hold {keys[0]}={num_workers} ranks of {cpus:g} CPU and {gpus:g} GPU each: room for "
            f"{num_workers - left} ({'; '.join(described) or 'no alive node'}); {left} more rank(s) need "
            f"{left * cpus:g} CPU{f' and {left * gpus:g} GPU' if gpus else ''} — add nodes or lower {keys[0]} / {keys[1]}"
        )
    return plan


class RayExecutor(Executor):
    """``num_workers`` Ray actors, ranks 0…N−1 of one process group.

    Args:
        worker_cls: the worker class every rank instantiates.
        config: the ``WorkerConfig`` every rank builds its worker from.
        num_workers: ranks (one GPU each when ``num_gpus_per_worker`` > 0).
        num_cpus_per_worker, num_gpus_per_worker: Ray resources of each actor.
        threads: torch CPU threads of each actor.
        backend: torch.distributed backend (default NCCL with GPUs, else gloo).
        address: the Ray cluster to join when Ray is not running yet (``auto``, ``host:port``, ``ray://…``);
            None starts a local one.
        rendezvous_timeout_s: seconds for placement and the process-group rendezvous.
        call_timeout_s: seconds a worker call may take (None: no limit).
        ray_init: further keyword arguments of ``ray.init`` when Ray is not running yet.
        process_group: the ranks join one torch.distributed group (false: independent workers, e.g. rollout
            replicas, each a world of one).
        keys: the config keys of ``num_workers`` and of the CPUs per rank (named in errors).
    """

    def __init__(self, worker_cls: type, config, *, num_workers: int, role: str = "actor_rollout_ref", num_cpus_per_worker: float = 1,
                 num_gpus_per_worker: float = 0, threads: int | None = None, backend: str | None = None, address: str | None = None,
                 rendezvous_timeout_s: float = 300.0, call_timeout_s: float | None = None, ray_init: dict | None = None,
                 process_group: bool = True, keys: tuple[str, str] = ("distributed.num_workers", "distributed.num_cpus_per_worker")):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_workers < 1:
            raise ValueError(f"{keys[0]} must be ≥ 1, got {num_workers}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            env = {"env_vars": {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}}
            ray.init(**{"address": address, "include_dashboard": False, "log_to_driver": True, "runtime_env": env, **(ray_init or {})})
        self.world_size = num_workers
        self.call_timeout_s = call_timeout_s
        self.actors, self.placement_groups = [], []
        bundle = {"CPU": float(num_cpus_per_worker), **({"GPU": float(num_gpus_per_worker)} if num_gpus_per_worker else {})}
        self.rank_nodes: list[str] = []
        try:
            self.plan = _node_plan(ray.nodes(), num_workers, float(num_cpus_per_worker), float(num_gpus_per_worker), ray.util.get_node_ip_address(), keys)
            for ip, count in self.plan:
                pg = placement_group([{**bundle, f"node:{ip}": 0.001}] * count, strategy="STRICT_PACK")
                self.placement_groups.append(pg)
                ready, _ = ray.wait([pg.ready()], timeout=rendezvous_timeout_s)
                if not ready:
                    raise TimeoutError(f"Ray could not reserve {count} × {bundle} on node {ip} within {rendezvous_timeout_s:g} s "
                                       "(busy with other work?); raise distributed.ray_rendezvous_timeout_s or free the node")
                for index in range(count):
                    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
                    options = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker, "scheduling_strategy": strategy}
                    self.actors.append(ray.remote(RankWorker).options(**options).remote(threads))
                    self.rank_nodes.append(ip)
            self.master_addr, self.master_port = self._get([self.actors[0].node_address.remote()], "the rendezvous address", rendezvous_timeout_s)[0]
            setups = [a.setup.remote(worker_cls, config, role, r, num_workers, self.master_addr, self.master_port, backend, rendezvous_timeout_s,
                                     process_group) for r, a in enumerate(self.actors)]
            self._get(setups, "the process-group rendezvous", rendezvous_timeout_s)
        except BaseException:
            for a in self.actors:
                ray.kill(a)
            for pg in self.placement_groups:
                remove_placement_group(pg)
            if self._owns_ray:
                ray.shutdown()
            raise

    def _get(self, refs: list, what: str, timeout_s: float | None) -> list:
        """``ray.get`` of one ref per rank (or of the first ranks), with errors that name the rank and its node."""
        import ray

        # answers are taken as they come: a dead rank is reported at once, while the live ones may be
        # blocked in a collective waiting for it
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending, results = list(refs), {}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = [f"rank {i} on {self.rank_nodes[i]}" for i, ref in enumerate(refs) if ref in pending]
                raise TimeoutError(f"{what} did not finish within {timeout_s:g} s: no answer from {', '.join(late)}")
            for ref in ready:
                i = refs.index(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise WorkerLostError(f"{what}: the worker of rank {i} on {self.rank_nodes[i]} died ({type(exc).__name__})") from None
                except ray.exceptions.RayTaskError:
                    # a live rank's collective fails ("connection reset by peer") when a peer dies; that
                    # error can arrive before the dead rank's: the lost rank is the cause to report
                    self._raise_if_a_rank_died(refs, pending, what)
                    raise
        return [results[i] for i in range(len(refs))]

    def _raise_if_a_rank_died(self, refs: list, pending: list, what: str, grace_s: float = 10.0) -> None:
        import ray

        done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
        for ref in done:
            i = refs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise WorkerLostError(f"{what}: the worker of rank {i} on {self.rank_nodes[i]} died ({type(exc).__name__})") from None
            except Exception:
                pass

    def call_all(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        return self.collect(self.submit(method, args_per_rank, kwargs), f"worker call {method}")

    def submit(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        """Start ``method`` on every rank without waiting: one Ray ref per rank (each actor runs its calls in order)."""
        return [a.execute.remote(method, args, kwargs) for a, args in zip(self.actors, args_per_rank)]

    def collect(self, refs: list, what: str) -> list:
        """The results of :meth:`submit`'s refs, in rank order (errors name the rank and node)."""
        return self._get(refs, what, self.call_timeout_s)

    def node_address(self, rank: int = 0) -> tuple[str, int]:
        """Rank ``rank``'s node address and a free port there (a rendezvous point of another group)."""
        return self._get([self.actors[rank].node_address.remote()], f"the address of rank {rank}", self.call_timeout_s)[0]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.actors, self.placement_groups = [], []
        if self._owns_ray:
            ray.shutdown()
