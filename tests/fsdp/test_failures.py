"""A rank that fails during training makes every other rank exit with an error naming it.

These cases need processes that really die, so they do not use the shared rank pools. The
training cases run :mod:`tests.fsdp.failing_rank` as plain scripts, one process per rank with
torchrun's environment variables, so an uncaught exception reaches ``sys.excepthook`` as in a
real job; :func:`spawn_world` (multiprocessing, used by the checkpoint crash test) runs a
function per rank and records a caught exception with ``record_failure`` as a harness must.
Both have a hard wall-clock limit after which the parent kills whatever is left, so the suite
never hangs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest
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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PG_TIMEOUT_S, ROLL_CALL_S = 8.0, 3.0


@dataclass
class ScriptRank:
    """How one rank's process ended: its return code, stderr, and when it was seen gone."""

    returncode: int
    stderr: str
    ended: float


def run_failing_job(world: int, how: str, victim: int, die_at: int = 2,
                    limit_s: float = WALL_LIMIT_S) -> tuple[list[ScriptRank], float]:
    """Run :mod:`tests.fsdp.failing_rank` on ``world`` ranks; return every rank's outcome and
    the time the victim started failing. Ranks other than the victim are waited for; the
    victim (alive only when it hangs) is killed once they have all exited."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    args = [how, str(victim), str(die_at), str(PG_TIMEOUT_S), str(ROLL_CALL_S)]
    procs, logs = [], []
    for rank in range(world):
        log = tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.fsdp.failing_rank", *args],
                                      cwd=REPO, env=dict(env, RANK=str(rank)),
                                      stdout=subprocess.DEVNULL, stderr=log))
        logs.append(log)
    deadline = time.monotonic() + limit_s
    ended: dict[int, float] = {}
    others = [rank for rank in range(world) if rank != victim]
    while time.monotonic() < deadline and not all(rank in ended for rank in others):
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.1)
    outcomes = []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        ended.setdefault(rank, time.time())
        log.seek(0)
        outcomes.append(ScriptRank(proc.returncode, log.read(), ended[rank]))
        log.close()
    found = re.search(r"FAILING AT ([0-9.]+)", outcomes[victim].stderr)
    assert found, f"the victim never reached its failure:\n{outcomes[victim].stderr[-3000:]}"
    return outcomes, float(found.group(1))


def _assert_survivors_name(outcomes: list[ScriptRank], failed_at: float, victim: int,
                           *expected: str) -> None:
    """Every rank but ``victim`` exited non-zero within the limit with a PeerFailureError
    whose message holds each of ``expected``."""
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            continue
        tail = outcome.stderr[-4000:]
        assert outcome.returncode != 0, (rank, tail)
        assert outcome.ended - failed_at < DETECT_LIMIT_S, (rank, outcome.ended - failed_at)
        assert "PeerFailureError" in outcome.stderr, (rank, tail)
        for text in expected:
            assert text in outcome.stderr, (rank, text, tail)


def test_rank_that_raises_is_named_by_every_other_rank() -> None:
    outcomes, failed_at = run_failing_job(3, "raise", victim=1)
    assert "rank 1 fails on purpose" in outcomes[1].stderr and outcomes[1].returncode != 0
    _assert_survivors_name(outcomes, failed_at, 1,
                           "rank 1 raised RuntimeError: rank 1 fails on purpose at step 2",
                           "all_gather over ranks [0-2] failed")
    for rank in (0, 2):  # the cause is known at once: no rank waits out the roll call
        assert outcomes[rank].ended - failed_at < ROLL_CALL_S + 5.0, rank


def test_killed_rank_is_named_as_not_answering() -> None:
    outcomes, failed_at = run_failing_job(3, "kill", victim=2)
    assert outcomes[2].returncode == -signal.SIGKILL
    _assert_survivors_name(outcomes, failed_at, 2, "rank(s) [2] did not answer within")


def test_hung_rank_is_named_after_the_process_group_timeout() -> None:
    outcomes, failed_at = run_failing_job(3, "hang", victim=1)
    _assert_survivors_name(outcomes, failed_at, 1, "rank(s) [1] did not answer within",
                           "Timed out waiting")
    for rank in (0, 2):  # the survivors can only notice when the process group times out
        assert outcomes[rank].ended - failed_at >= PG_TIMEOUT_S - 1.0, rank


def test_store_host_rank_0_failing_is_named() -> None:
    """Rank 0 hosts the rendezvous store under ``env://``: when it dies, the log dies with
    it, and the survivors say so, naming rank 0."""
    outcomes, failed_at = run_failing_job(3, "raise", victim=0)
    _assert_survivors_name(outcomes, failed_at, 0, "rank 0 has most likely exited")


def test_peer_failure_error_survives_pickling() -> None:
    import pickle

    from ragged_dtensor import PeerFailureError

    error = PeerFailureError("all_gather failed", op="all_gather", group_ranks=[0, 1, 2],
                             raised={1: "RuntimeError: boom"}, silent=[2], store_error=None)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.op, copy.group_ranks, copy.raised, copy.silent) == (
        "all_gather failed", "all_gather", [0, 1, 2], {1: "RuntimeError: boom"}, [2])


@pytest.mark.parametrize("message", [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:30401. This is typically caused by a remote worker crashing.",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:12718: Connection reset by peer.",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 5000ms for recv operation to complete",
])
def test_transport_errors_are_told_from_argument_errors(message: str) -> None:
    """The messages are gloo's own, as measured on this machine's torch 2.13 build."""
    from ragged_dtensor.peer_failure import PeerFailureError, is_transport_error

    assert is_transport_error(RuntimeError(message))
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as exc:
            raise ValueError("wrapped") from exc
    except ValueError as wrapped:
        assert is_transport_error(wrapped)
    assert not is_transport_error(PeerFailureError("x", op="o", group_ranks=[], raised={},
                                                   silent=[], store_error=None))
    assert not is_transport_error(RuntimeError("output tensor size must be equal to world_size "
                                               "times input tensor size"))


def _argument_error_passes_through() -> tuple[str, float]:
    from dbuffer.collectives import all_gather_into

    started = time.monotonic()
    try:
        all_gather_into(torch.empty(3), torch.ones(2), dist.group.WORLD, False)
    except Exception as exc:  # noqa: BLE001 - returned for the assertion
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "no error", time.monotonic() - started


def test_argument_error_in_a_guarded_collective_is_not_a_peer_failure(ranks) -> None:
    """A collective's own bad arguments fail on the rank that passed them, unchanged, without
    a roll call (which would wait and then blame healthy peers)."""
    for text, seconds in ranks.run(2, _argument_error_passes_through):
        assert "PeerFailureError" not in text and text != "no error", text
        assert seconds < 1.0, (text, seconds)
