"""Run one benchmark function on several CPU gloo ranks, spawned for this script alone.

Benchmarks measure side by side in one run, so every rank runs the same function (one
thread each: oversubscribing two cores makes timings meaningless) and rank 0's return value
comes back to the script.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any],
               args: tuple[Any, ...], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    result = fn(*args)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def run_on_gloo_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                      timeout_s: float = 1800) -> Any:
    """``fn(*args)`` on ``world_size`` spawned gloo ranks; returns rank 0's result.

    ``fn`` must be a module-level function of the benchmark script (spawned ranks import it).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=timeout_s)
    for proc in procs:
        proc.join()
    return result
