"""Start the ranks: under ``torchrun`` use its environment, otherwise spawn them here.

With ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set (``torchrun``, single- or multi-node), every
process is already a rank: it joins the process group over NCCL on its ``LOCAL_RANK`` GPU
when CUDA is available, gloo on CPU otherwise. Without them the command spawns
``world_size`` CPU processes itself and connects them over gloo on a free local port, so one
command trains on any laptop.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = datetime.timedelta(minutes=10)


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher setting its env)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def launch(fn: Callable[[Any], object], arg: Any, world_size: int) -> None:
    """Run ``fn(arg)`` on every rank of an initialised default process group.

    Args:
        fn: a module-level function (spawned processes import it).
        arg: its argument (picklable).
        world_size: CPU ranks to spawn when not under ``torchrun`` (ignored under it).
    """
    if under_torchrun():
        _join_torchrun(fn, arg)
    else:
        mp.start_processes(_spawned_rank, args=(world_size, _free_port(), fn, arg),
                           nprocs=world_size, start_method="spawn")


def device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _join_torchrun(fn: Callable[[Any], object], arg: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        fn(arg)
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, port: int, fn: Callable[[Any], object], arg: Any) -> None:
    # The ranks share this machine's cores: oversubscribing them slows every collective.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    try:
        fn(arg)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
