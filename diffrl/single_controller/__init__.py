"""Single-controller execution: one driver calls methods on a group of workers (verl's pattern).

``register(dispatch_mode=…)`` marks how a worker method's input is split and its outputs merged;
``LocalWorkerGroup`` runs one worker in the driver's process (the embedded default),
``RayWorkerGroup`` runs one Ray actor per rank with torch.distributed and FSDP2.
"""

from diffrl.single_controller.base import Dispatch, WorkerGroup, arrange_for_data_parallel, build_worker_group, register

__all__ = ["Dispatch", "WorkerGroup", "arrange_for_data_parallel", "build_worker_group", "register"]
