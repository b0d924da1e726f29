"""What importing ragged_dtensor costs ops on plain (``Shard(0)`` / ``Replicate``) DTensors.

ragged_dtensor answers some ops on RaggedShard inputs itself (reductions, reshapes, random
fills, fused optimizer steps, the ops torch's own custom handlers take). This benchmark times
those ops, plus ``add`` as a control, on plain DTensors in two single-rank gloo processes
started side by side: one installed ragged_dtensor's torch patches, the other did not. The parent alternates
between them, op by op, so load noise hits both alike, and reports medians of per-call times
and the ratio with / without (1.00 = no overhead), and the ratio of the fastest rounds (the
least disturbed by other load). Small tensors, so the dispatch overhead dominates. Timings on
a shared CPU are noisy: compare ratios, rerun before concluding.

Run: ``python benchmarks/ragged_handlers.py [--rounds 9 --iters 200]``.
Writes ``benchmarks/results/ragged_handlers.json`` (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from gloo_ranks import _free_port

RESULT = Path(__file__).parent / "results" / "ragged_handlers.json"

Op = Callable[[torch.Tensor, dict[str, object]], object]

#: name -> op on a DTensor ``x`` of shape (64, 32); ``extra`` holds other inputs
OPS: dict[str, Op] = {
    "add (control)": lambda x, e: x + x,
    "view": lambda x, e: x.view(-1),
    "reshape": lambda x, e: x.reshape(32, 64),
    "max": lambda x, e: x.max(),
    "min": lambda x, e: x.min(),
    "amax": lambda x, e: x.amax(),
    "amin": lambda x, e: x.amin(),
    "mean": lambda x, e: x.mean(),
    "vector_norm": lambda x, e: torch.linalg.vector_norm(x),
    "vector_norm inf": lambda x, e: torch.linalg.vector_norm(x, float("inf")),
    "_foreach_norm": lambda x, e: torch._foreach_norm([x, x]),
    "uniform_": lambda x, e: x.uniform_(),
    "argmax": lambda x, e: x.argmax(),
    "as_strided (alias)": lambda x, e: x.as_strided(x.shape, x.stride()),
    "conv2d": lambda x, e: torch.nn.functional.conv2d(e["image"], e["kernel"]),
    "amp unscale": lambda x, e: torch._amp_foreach_non_finite_check_and_unscale_(
        [x], e["found_inf"], e["inv_scale"]),
    "_fused_adamw_": lambda x, e: torch._fused_adamw_(
        [x], [e["grad"]], [e["m"]], [e["v"]], [], [e["step"]], lr=1e-3, beta1=0.9,
        beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False),
}

PLACEMENTS = ("Shard(0)", "Replicate")


def _worker(with_ragged: bool, port: int, conn: Connection) -> None:
    """A one-rank gloo process; times ``(op, placement, iters)`` requests until told to stop."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if with_ragged:
        import ragged_dtensor

        ragged_dtensor.install()  # the hooks under test (importing alone installs nothing)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (1,))

    def make(placement: str, *shape: int) -> torch.Tensor:
        p = Shard(0) if placement == "Shard(0)" else Replicate()
        return distribute_tensor(torch.randn(*shape), mesh, [p])

    while (request := conn.recv()) is not None:
        name, placement, iters = request
        x = make(placement, 64, 32)
        extra = {
            "image": make(placement, 2, 3, 16, 16), "kernel": make("Replicate", 4, 3, 3, 3),
            "found_inf": torch.zeros(1), "inv_scale": torch.ones(1),
            "grad": make(placement, 64, 32), "m": make(placement, 64, 32),
            "v": make(placement, 64, 32), "step": torch.ones(()),
        }
        op = OPS[name]
        for _ in range(3):
            op(x, extra)
        start = time.perf_counter()
        for _ in range(iters):
            op(x, extra)
        conn.send((time.perf_counter() - start) / iters * 1e6)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    conns, procs = {}, []
    for with_ragged in (False, True):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(with_ragged, _free_port(), child))
        proc.start()
        conns[with_ragged], procs = parent, procs + [proc]

    rows = []
    print(f"{'op':22} {'placement':10} {'without us':>11} {'with us':>9} {'ratio':>6} "
          f"{'min ratio':>9}")
    for name in OPS:
        for placement in PLACEMENTS:
            times: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(args.rounds):
                order = (False, True) if round_ % 2 == 0 else (True, False)
                for with_ragged in order:
                    conns[with_ragged].send((name, placement, args.iters))
                    times[with_ragged].append(conns[with_ragged].recv())
            without, with_ = statistics.median(times[False]), statistics.median(times[True])
            min_ratio = min(times[True]) / min(times[False])
            rows.append({"op": name, "placement": placement, "without_us": round(without, 2),
                         "with_us": round(with_, 2), "ratio": round(with_ / without, 3),
                         "min_ratio": round(min_ratio, 3)})
            print(f"{name:22} {placement:10} {without:11.1f} {with_:9.1f} {with_ / without:6.2f} "
                  f"{min_ratio:9.2f}")
    for conn in conns.values():
        conn.send(None)
    for proc in procs:
        proc.join()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "per-call time of ops on plain DTensors, with / without import ragged_dtensor",
        "torch": torch.__version__, "rounds": args.rounds, "iters": args.iters,
        "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
