"""A rank that dies during training makes every other rank fail with an error, quickly.

These cases need processes that really die, so they do not use the shared rank pools: each
spawns its own gloo world (:func:`spawn_world`) with a short process-group timeout
(``COLLECTIVE_TIMEOUT_S``, the knob fsdp relies on: ``init_process_group(timeout=...)``) and a
hard wall-clock limit after which the parent kills whatever is left, so the suite never hangs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tests.harness import _free_port

COLLECTIVE_TIMEOUT_S = 20.0
WALL_LIMIT_S = 120.0
DETECT_LIMIT_S = 60.0


@dataclass
class RankOutcome:
    """How one spawned rank ended: ``kind`` is ``"ok"``, ``"err"`` or ``"died"`` (no report,
    e.g. SIGKILL); ``payload`` the result or error text; ``at`` the wall time of the report."""

    kind: str
    payload: Any
    at: float
    exitcode: int | None


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           conn: Connection) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit non-zero
        conn.send(("err", f"{type(exc).__name__}: {exc}", time.time()))
        os._exit(1)
    conn.send(("ok", result, time.time()))
    dist.destroy_process_group()


def spawn_world(world: int, fn: Callable[..., Any], *args: Any,
                limit_s: float = WALL_LIMIT_S) -> list[RankOutcome]:
    """Run ``fn(*args)`` on ``world`` fresh gloo ranks; kill any still alive after ``limit_s``."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_entry, args=(fn, rank, world, port, args, child), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    deadline = time.monotonic() + limit_s
    outcomes = []
    for proc, conn in zip(procs, conns):
        report = None
        while report is None and time.monotonic() < deadline:
            if conn.poll(0.2):
                try:
                    report = conn.recv()
                except EOFError:
                    break
            elif not proc.is_alive() and not conn.poll(0):
                break
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
        kind, payload, at = report if report is not None else ("died", None, time.time())
        outcomes.append(RankOutcome(kind, payload, at, proc.exitcode))
        conn.close()
    return outcomes


def train_until_rank_dies(victim: int, die_at: int) -> str:
    """Train the tiny decoder with fsdp; rank ``victim`` raises at step ``die_at``."""
    from tests.fsdp import models
    from tests.fsdp.test_checkpoint import _shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.build_model()
    _shard(model, "fsdp", None)
    spec = models.RunSpec("sgd", steps=die_at + 3)
    optimizer = models.make_optimizer(spec, [(n, p) for n, p in model.named_parameters()
                                             if p.requires_grad])
    per_rank = spec.global_batch // world
    for step, tokens in enumerate(models.batches(spec)):
        if rank == victim and step == die_at:
            raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
        models._loss(model, tokens[rank * per_rank:(rank + 1) * per_rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


def test_dying_rank_makes_every_rank_fail_within_60s() -> None:
    outcomes = spawn_world(3, train_until_rank_dies, 1, 2)
    victim = outcomes[1]
    assert victim.kind == "err" and "fails on purpose" in victim.payload, victim
    for rank in (0, 2):
        survivor = outcomes[rank]
        assert survivor.kind == "err", (rank, survivor)
        assert survivor.exitcode != 0, (rank, survivor)
        assert survivor.at - victim.at < DETECT_LIMIT_S, (rank, survivor.at - victim.at)
