"""One rank of a training job in which one rank fails on purpose, run as a plain script.

``python -m tests.fsdp.failing_rank <how> <victim> <die_at> <pg_timeout_s> <roll_call_s>``
reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` as torchrun sets them,
trains the tiny decoder with fsdp and, on rank ``victim`` at step ``die_at``, fails in one of
three ways (``how``): ``raise`` (an uncaught exception, which goes through
``sys.excepthook`` as in a real job), ``kill`` (SIGKILL: nothing is logged) or ``hang``
(sleeps while the others wait in a collective). Before failing, the victim prints
``FAILING AT <unix time>`` so the parent can time the others' exits.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main(how: str, victim: int, die_at: int, pg_timeout_s: float, roll_call_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))

    import fsdp
    from tests.fsdp import models
    from tests.harness import device_mesh

    fsdp.set_roll_call_timeout(roll_call_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.build_model()
    spec = models.RunSpec("sgd", steps=die_at + 3)
    models.shard(model, "fsdp", spec, device_mesh(world))
    optimizer = models.make_optimizer(spec, [(n, p) for n, p in model.named_parameters()
                                             if p.requires_grad])
    per_rank = spec.global_batch // world
    for step, tokens in enumerate(models.batches(spec)):
        if rank == victim and step == die_at:
            print(f"FAILING AT {time.time()}", file=sys.stderr, flush=True)
            if how == "raise":
                raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        models._loss(model, tokens[rank * per_rank:(rank + 1) * per_rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    print("finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    how, victim, die_at, pg_timeout_s, roll_call_s = sys.argv[1:]
    main(how, int(victim), int(die_at), float(pg_timeout_s), float(roll_call_s))
