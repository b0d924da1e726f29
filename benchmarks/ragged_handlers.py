"""What importing ragged_dtensor costs ops on plain (``Shard(0)`` / ``Replicate``) DTensors.

ragged_dtensor answers some ops on RaggedShard inputs itself (reductions, reshapes, random
fills, fused optimizer steps, the ops torch's own custom handlers take). This benchmark times
those ops, plus ``add`` as a control, on plain DTensors in two single-rank gloo processes
started side by side: one installed ragged_dtensor's torch patches, the other did not. The parent alternates
between them, op by op, so load noise hits both alike, and reports medians of per-call times
and the ratio with / without (1.00 = no overhead), and the ratio of the fastest rounds (the
least disturbed by other load). Small tensors, so the dispatch overhead dominates. Timings on
a shared CPU are noisy: compare ratios, rerun before concluding.

A pair of processes also carries its own bias, the same in every round: ``view`` on
``Shard(0)`` read 1.40 in one pair and 0.63 in another with no change in between (where each
process's tensors and caches landed). So the measurement is repeated over ``--pairs`` fresh pairs, both workers
pinned to the same core, and each row reports the median over pairs of the pair's ratio.

Below a few percent the ratios cannot tell overhead from noise (the control op ``add``, which
no patch touches, reads up to 1.06). For the ops whose entry in DTensor's custom-op table
ragged_dtensor wraps (torch's own handlers, reached on every call), the process with the
patches also times the wrapper's own work, the route's RaggedShard check (the route is bound
when the entry is made), against torch's handler on the same arguments: a bound on the
overhead that noise cannot move. ``from_local`` reaches a replaced function
(``_FromTorchTensor.forward``) on every call: that process times it against torch's original
on the same arguments, interleaved, for the same kind of bound. The
other ops leave C++'s sharding cache only on a miss, so they add nothing per call.

Run: ``python benchmarks/ragged_handlers.py [--pairs 5 --rounds 9 --iters 200]``.
Writes ``benchmarks/results/ragged_handlers.json`` (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from gloo_ranks import _free_port
from torch.autograd.function import FunctionCtx
from torch.distributed.tensor import DTensor, Replicate

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
    "from_local": lambda x, e: DTensor.from_local(x._local_tensor, x.device_mesh, x.placements,
                                                  run_check=False),
    "redistribute to Replicate": lambda x, e: x.redistribute(x.device_mesh, [Replicate()]),
    "_fused_adamw_": lambda x, e: torch._fused_adamw_(
        [x], [e["grad"]], [e["m"]], [e["v"]], [], [e["step"]], lr=1e-3, beta1=0.9,
        beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False),
}

PLACEMENTS = ("Shard(0)", "Replicate")


WRAPPER_WORK = "wrapper work"

#: the ops whose custom-op table entry ragged_dtensor wraps, with arguments built from the
#: worker's tensors (a RaggedShard-free call: what every plain DTensor call pays)
WRAPPED_CALLS: dict[str, Callable[[torch.Tensor, dict[str, object]], tuple[object, ...]]] = {
    "argmax": lambda x, e: (x,),
    "argmin": lambda x, e: (x,),
    "as_strided": lambda x, e: (x, tuple(x.shape), x.stride()),
    "convolution": lambda x, e: (e["image"], e["kernel"], None, [1, 1], [0, 0], [1, 1], False,
                                 [0, 0], 1),
    "_amp_foreach_non_finite_check_and_unscale_": lambda x, e: ([x], e["found_inf"],
                                                                e["inv_scale"]),
}


#: the replaced functions (not custom-op table entries) that an op above reaches on every
#: call, with arguments: timed against torch's original on the same arguments, interleaved
PATCHED_CALLS: dict[str, tuple[str, Callable[[torch.Tensor], tuple[object, ...]]]] = {
    "from_local (_FromTorchTensor.forward)": (
        "torch.distributed.tensor._api._FromTorchTensor.forward",
        lambda x: (FunctionCtx(), x._local_tensor, x.device_mesh, tuple(x.placements), False)),
}


def _best_us(fn: Callable[[], object], n: int) -> float:
    """The fastest of 5 runs of ``n`` calls, in microseconds per call."""
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def _wrapper_work(x: torch.Tensor, extra: dict[str, object],
                  iters: int) -> dict[str, tuple[float, float]]:
    """Per wrapped op: microseconds per call of the wrapper's own work (what it does before
    handing the call to torch's handler) and of torch's handler itself. For a replaced
    function (:data:`PATCHED_CALLS`) the own work is the difference between the replacement
    and torch's original on the same arguments (the fastest of 5 alternating runs of 10 x
    ``iters`` calls each: the difference is a few percent of either)."""
    from ragged_dtensor.torch_patches import stored_objects

    table = DTensor._op_dispatcher._custom_op_handlers
    out = {}
    for name, make_args in WRAPPED_CALLS.items():
        op = getattr(torch.ops.aten, name).default
        entry, args = table[op], make_args(x, extra)
        wants = entry.route.wants
        own = _best_us(lambda: wants(args, {}), 50 * iters)
        out[name] = (own, _best_us(lambda: entry.torch_handler(op, args, {}), iters))
    stored = stored_objects()
    for name, (symbol, make_args) in PATCHED_CALLS.items():
        original, replacement = (getattr(f, "__func__", f) for f in stored[symbol])
        args = make_args(x)
        runs: dict[Callable[..., object], float] = {original: math.inf, replacement: math.inf}
        for _ in range(5):
            for fn in runs:
                runs[fn] = min(runs[fn], _best_us(lambda: fn(*args), 10 * iters))
        out[name] = (max(0.0, runs[replacement] - runs[original]), runs[original])
    return out


def _worker(with_ragged: bool, port: int, conn: Connection, core: int) -> None:
    """A one-rank gloo process on CPU ``core``; times ``(op, placement, iters)`` requests
    until told to stop."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if with_ragged:
        import ragged_dtensor

        ragged_dtensor.install()  # the hooks under test (importing alone installs nothing)

    os.sched_setaffinity(0, {core})
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
        if name == WRAPPER_WORK:
            conn.send(_wrapper_work(x, extra, iters))
            continue
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
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()

    core = max(os.sched_getaffinity(0))
    pairs = [_measure_pair(core, args.rounds, args.iters) for _ in range(args.pairs)]
    rows = []
    print(f"{'op':22} {'placement':10} {'without us':>11} {'with us':>9} {'ratio':>6} "
          f"{'min ratio':>9}  per pair")
    for key in pairs[0]:
        name, placement = key
        if name == WRAPPER_WORK:
            continue
        per_pair = [pair[key] for pair in pairs]
        without = statistics.median(p["without"] for p in per_pair)
        with_ = statistics.median(p["with"] for p in per_pair)
        ratio = statistics.median(p["with"] / p["without"] for p in per_pair)
        min_ratio = min(p["min_with"] for p in per_pair) / min(p["min_without"] for p in per_pair)
        rows.append({"op": name, "placement": placement, "without_us": round(without, 2),
                     "with_us": round(with_, 2), "ratio": round(ratio, 3),
                     "min_ratio": round(min_ratio, 3),
                     "pair_ratios": [round(p["with"] / p["without"], 3) for p in per_pair]})
        print(f"{name:22} {placement:10} {without:11.1f} {with_:9.1f} {ratio:6.2f} "
              f"{min_ratio:9.2f}  {' '.join(f'{r:.2f}' for r in rows[-1]['pair_ratios'])}")

    wrapper = []
    print(f"\n{'wrapped op':44} {'placement':10} {'own work us':>11} {'torch us':>9} {'share':>6}")
    for placement in PLACEMENTS:
        for name, (own, handler) in pairs[0][(WRAPPER_WORK, placement)].items():
            wrapper.append({"op": name, "placement": placement, "own_work_us": round(own, 3),
                            "torch_handler_us": round(handler, 2),
                            "bound_ratio": round(1 + own / handler, 4)})
            print(f"{name:44} {placement:10} {own:11.2f} {handler:9.1f} {own / handler:6.1%}")
    print(f"largest bound on the wrapped ops' overhead: "
          f"{max(w['bound_ratio'] for w in wrapper):.3f}x")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "per-call time of ops on plain DTensors, with / without import ragged_dtensor",
        "torch": torch.__version__, "pairs": args.pairs, "rounds": args.rounds,
        "iters": args.iters, "rows": rows, "wrapper_work": wrapper,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


def _measure_pair(core: int, rounds: int, iters: int) -> dict[tuple[str, str], Any]:
    """One pair of fresh workers (without / with the patches) on ``core``: per (op, placement)
    the medians and minima of their per-call times over ``rounds`` alternating rounds, and
    per placement under :data:`WRAPPER_WORK` the patched worker's :func:`_wrapper_work`."""
    ctx = mp.get_context("spawn")
    conns, procs = {}, []
    for with_ragged in (False, True):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(with_ragged, _free_port(), child, core))
        proc.start()
        conns[with_ragged], procs = parent, procs + [proc]
    out = {}
    for name in OPS:
        for placement in PLACEMENTS:
            times: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(rounds):
                order = (False, True) if round_ % 2 == 0 else (True, False)
                for with_ragged in order:
                    conns[with_ragged].send((name, placement, iters))
                    times[with_ragged].append(conns[with_ragged].recv())
            out[(name, placement)] = {
                "without": statistics.median(times[False]), "with": statistics.median(times[True]),
                "min_without": min(times[False]), "min_with": min(times[True])}
    for placement in PLACEMENTS:
        conns[True].send((WRAPPER_WORK, placement, iters))
        out[(WRAPPER_WORK, placement)] = conns[True].recv()
    for conn in conns.values():
        conn.send(None)
    for proc in procs:
        proc.join()
    return out


if __name__ == "__main__":
    main()
