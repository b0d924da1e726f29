"""A rank that fails during fsdp training makes every other rank exit with an error naming it.

These cases need processes that really die, so they do not use the shared rank pools. The
training cases run :mod:`tests.failing_job` (plain scripts, one process per rank with
torchrun's environment variables, so an uncaught exception reaches ``sys.excepthook`` as in a
real job); :func:`spawn_world` (multiprocessing, used by the checkpoint crash test) runs a
function per rank and records a caught exception with ``record_failure`` as a harness must.
Both have a hard wall-clock limit after which the parent kills whatever is left, so the suite
never hangs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tests.failing_job import WALL_LIMIT_S, ScriptRank, assert_others_name, run_failing_job
from tests.harness import _free_port

COLLECTIVE_TIMEOUT_S = 20.0
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
        from ragged_dtensor import record_failure

        record_failure(exc)  # what sys.excepthook would have done, for the peers' roll call
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


PG_TIMEOUT_S, ROLL_CALL_S = 8.0, 3.0


def _fsdp_job(how: str, victim: int, agent_store: bool = True) -> tuple[list[ScriptRank], float]:
    """The job launched as torchrun does (the store in the launcher) unless ``agent_store`` is
    False (plain ``env://``: rank 0 hosts the store)."""
    return run_failing_job(3, "fsdp", how, victim, pg_timeout_s=PG_TIMEOUT_S,
                           roll_call_s=ROLL_CALL_S, agent_store=agent_store)


def test_rank_that_raises_is_named_by_every_other_rank() -> None:
    outcomes, failed_at = _fsdp_job("raise", victim=1)
    assert "rank 1 fails on purpose" in outcomes[1].stderr and outcomes[1].returncode != 0
    assert_others_name(outcomes, failed_at, 1, DETECT_LIMIT_S,
                       "rank 1 raised RuntimeError: rank 1 fails on purpose at step 2",
                       "all_gather over ranks [0-2] failed")
    for rank in (0, 2):  # the cause is known at once: no rank waits out the roll call
        assert outcomes[rank].ended - failed_at < ROLL_CALL_S + 5.0, rank


def test_killed_rank_is_named_as_not_answering() -> None:
    outcomes, failed_at = _fsdp_job("kill", victim=2)
    assert outcomes[2].returncode == -signal.SIGKILL
    assert_others_name(outcomes, failed_at, 2, DETECT_LIMIT_S,
                       "rank(s) [2] did not answer within")


def test_hung_rank_is_named_after_the_process_group_timeout() -> None:
    outcomes, failed_at = _fsdp_job("hang", victim=1)
    assert_others_name(outcomes, failed_at, 1, DETECT_LIMIT_S, "rank(s) [1] did not answer within")
    for rank in (0, 2):  # the survivors can only notice when the process group times out
        assert outcomes[rank].ended - failed_at >= PG_TIMEOUT_S - 1.0, rank
    # the first to notice saw gloo's timeout; a later one may see that rank's exit instead
    assert any("Timed out waiting" in outcomes[rank].stderr for rank in (0, 2))


def test_store_host_rank_0_failing_is_named() -> None:
    """Rank 0 hosts the rendezvous store under ``env://``: when it dies, the log dies with
    it, and the others say so, naming rank 0."""
    outcomes, failed_at = _fsdp_job("raise", victim=0, agent_store=False)
    assert_others_name(outcomes, failed_at, 0, DETECT_LIMIT_S, "rank 0 has most likely exited")
