"""A job in which one rank fails on purpose, run as plain scripts, one process per rank.

:func:`run_failing_job` starts ``python -m tests.failing_job <workload> <how> <victim> <die_at>
<pg_timeout_s> <roll_call_s>`` once per rank with the environment variables torchrun sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so an uncaught exception reaches
``sys.excepthook`` as in a real job. Each rank runs a workload step by step: ``fsdp`` trains
the tiny decoder with fsdp, ``ragged`` redistributes a RaggedShard tensor to Replicate and
back. On rank ``victim`` at step ``die_at`` it fails in one of three ways (``how``): ``raise``
(an uncaught exception), ``kill`` (SIGKILL: nothing is logged) or ``hang`` (sleeps while the
others wait in a collective). Before failing, the victim prints ``FAILING AT <unix time>`` so
the parent can time the others' exits. The parent kills whatever is left after a hard limit,
so a test never hangs.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.harness import _free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALL_LIMIT_S = 120.0


def fsdp_steps(steps: int) -> Iterator[Callable[[], None]]:
    """Training steps of the tiny decoder, wrapped with fsdp (each block, then the root)."""
    from tests.fsdp import models
    from tests.harness import device_mesh

    model = models.build_model()
    spec = models.RunSpec("sgd", steps=steps)
    models.shard(model, "fsdp", spec, device_mesh(dist.get_world_size()))
    optimizer = models.make_optimizer(spec, [(n, p) for n, p in model.named_parameters()
                                             if p.requires_grad])
    for index in range(steps):
        yield lambda index=index: models.sharded_steps(model, optimizer, spec, index, index + 1)


def ragged_steps(steps: int) -> Iterator[Callable[[], None]]:
    """A RaggedShard tensor (units 1, 2, ..., 0: uneven, the last rank holds none) to Replicate
    and back; 18 rows divide into whole units at world sizes 2 to 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    from ragged_dtensor import RaggedShard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ragged = [RaggedShard((0,), [*range(1, world), 0])]
    tensor = distribute_tensor(torch.arange(54.0).view(18, 3), mesh, ragged)
    for _ in range(steps):
        yield lambda: tensor.redistribute(mesh, [Replicate()]).redistribute(mesh, ragged)


WORKLOADS = {"fsdp": fsdp_steps, "ragged": ragged_steps}


def main(workload: str, how: str, victim: int, die_at: int, pg_timeout_s: float,
         roll_call_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))

    from ragged_dtensor import set_roll_call_timeout

    set_roll_call_timeout(roll_call_s)
    for index, step in enumerate(WORKLOADS[workload](die_at + 3)):
        if dist.get_rank() == victim and index == die_at:
            print(f"FAILING AT {time.time()}", file=sys.stderr, flush=True)
            if how == "raise":
                raise RuntimeError(f"rank {victim} fails on purpose at step {index}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        step()
    dist.destroy_process_group()


@dataclass
class ScriptRank:
    """How one rank's process ended: its return code, stderr, and when it was seen gone."""

    returncode: int
    stderr: str
    ended: float


def run_failing_job(world: int, workload: str, how: str, victim: int, *, die_at: int = 2,
                    pg_timeout_s: float = 8.0, roll_call_s: float = 3.0, agent_store: bool = True,
                    limit_s: float = WALL_LIMIT_S) -> tuple[list[ScriptRank], float]:
    """Run the job on ``world`` ranks; every rank's outcome and the time the victim started
    failing. Ranks other than the victim are waited for; the victim (alive only when it
    hangs) is killed once they have all exited, and everything after ``limit_s``.

    With ``agent_store`` this process hosts the rendezvous store, as torchrun's agent does
    (``TORCHELASTIC_USE_AGENT_STORE``), so it outlives every rank; without, rank 0 hosts it
    (plain ``env://``) and takes it along when it exits.
    """
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               TORCHELASTIC_USE_AGENT_STORE=str(agent_store),
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True,
                          wait_for_workers=False) if agent_store else None
    args = [workload, how, str(victim), str(die_at), str(pg_timeout_s), str(roll_call_s)]
    procs, logs = [], []
    for rank in range(world):
        log = tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.failing_job", *args],
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
    del store  # the agent's store lives until every rank has ended
    found = re.search(r"FAILING AT ([0-9.]+)", outcomes[victim].stderr)
    assert found, f"the victim never reached its failure:\n{outcomes[victim].stderr[-3000:]}"
    return outcomes, float(found.group(1))


def assert_others_name(outcomes: list[ScriptRank], failed_at: float, victim: int,
                       limit_s: float, *expected: str) -> None:
    """Every rank but ``victim`` exited non-zero within ``limit_s`` of the failure, with a
    PeerFailureError whose message holds each of ``expected``."""
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            continue
        tail = outcome.stderr[-4000:]
        assert outcome.returncode != 0, (rank, tail)
        assert outcome.ended - failed_at < limit_s, (rank, outcome.ended - failed_at)
        assert "PeerFailureError" in outcome.stderr, (rank, tail)
        for text in expected:
            assert text in outcome.stderr, (rank, text, tail)


if __name__ == "__main__":
    workload, how, victim, die_at, pg_timeout_s, roll_call_s = sys.argv[1:]
    main(workload, how, int(victim), int(die_at), float(pg_timeout_s), float(roll_call_s))
