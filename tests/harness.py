"""Persistent multi-process gloo workers for distributed tests.

Spawning a fresh group of processes per test case costs seconds (each imports torch), which
does not fit the suite's time budget on two cores. Instead, a :class:`RankPool` keeps
``world_size`` worker processes alive for the whole session, each a rank of one gloo process
group, and feeds them test cases one after another.

A case is a module-level function plus arguments. It is pickled in the parent and every rank
runs the *same* call, so randomised cases must be drawn in the parent (seeded) and passed as
arguments, never drawn independently on each rank.

Failure handling is what makes the pool safe to reuse:

* every rank's exception comes back with its formatted traceback and is raised in the parent
  as :class:`RankFailure`, naming the rank;
* when one rank fails, the others are given a short grace period to finish (or fail in their
  own collective), then the pool is torn down, so a rank stuck in a collective can never hang
  the suite; the next case starts a fresh pool;
* a case that runs past its timeout kills the pool and raises :class:`RankTimeout`.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
ERROR_GRACE_S = 5.0
COLLECTIVE_TIMEOUT_S = 90.0


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds every failing rank's traceback."""

    def __init__(self, failures: dict[int, str], missing: list[int]) -> None:
        self.failures = failures
        self.missing = missing
        parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            parts.append(f"--- ranks {missing} did not finish (pool restarted) ---")
        super().__init__("\n".join(parts))


class RankTimeout(RankFailure):
    """Some ranks neither returned nor raised within the timeout."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    conn.send(("ready", None))
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            fn, args, kwargs = message
            try:
                result = fn(*args, **kwargs)
                conn.send(("ok", result))
            except BaseException:  # noqa: BLE001 - every failure must reach the parent
                conn.send(("err", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` persistent gloo ranks that run test cases on demand."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, self.world_size, port, child), daemon=True
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        ready = self._collect(time.monotonic() + DEFAULT_TIMEOUT_S)
        if set(ready) != set(range(self.world_size)):
            self.close()
            raise RuntimeError(f"rank pool of size {self.world_size} failed to start: {ready}")

    def _collect(self, deadline: float) -> dict[int, tuple[str, Any]]:
        """Gather one reply per rank until all replied, the deadline passed, or
        (after a first error) the grace period ran out."""
        replies: dict[int, tuple[str, Any]] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    replies[rank] = ("err", f"rank {rank} process died (exit code "
                                            f"{self._procs[rank].exitcode})")
                if replies[rank][0] == "err":
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        return replies

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(time.monotonic() + timeout)
        failures = {r: payload for r, (kind, payload) in replies.items() if kind == "err"}
        missing = [r for r in range(self.world_size) if r not in replies]
        if missing or failures:
            # A rank that failed may have left its peers inside a collective, or paired a
            # collective wrongly: never reuse a process group after a failure.
            self.close()
            if missing and not failures:
                raise RankTimeout({}, missing)
            raise RankFailure(failures, missing)
        return [replies[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


class RankPools:
    """One lazily started :class:`RankPool` per world size, shared by the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any,
            timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size].run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@functools.cache
def device_mesh(*shape: int, names: tuple[str, ...] | None = None) -> Any:
    """A CPU device mesh over the worker's default group, built once per worker process.

    Building a 2-D mesh creates sub-groups (a collective); caching keeps every later case
    cheap. Call it from inside a case function.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)
