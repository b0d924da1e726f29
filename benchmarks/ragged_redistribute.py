"""Time each RaggedShard redistribution on 4 gloo ranks against the equivalent torch Shard redistribution.

Each row redistributes the same fp32 tensor: once from/to a RaggedShard (uneven units
``(3, 2, 3, 0)``: rank 3 holds nothing) and once the same movement with torch's even ``Shard``
placements, and prints the time ratio ragged / torch. The time of one run is the slowest rank's
time (ranks are barrier-synchronised before every run); the two are run alternately and the
table shows medians.

Run: ``python benchmarks/ragged_redistribute.py [--rows 1024 --cols 1024 --iters 20]``.
Writes ``benchmarks/results/ragged_redistribute.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gloo_ranks import run_on_gloo_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

WORLD = 4
UNITS = (3, 2, 3, 0)
ONE_HOT = (0, 0, 1, 0)
RESULT = Path(__file__).parent / "results" / "ragged_redistribute.json"


def _run_once(fn: Callable[[], object]) -> float:
    """Seconds of one run on the slowest rank (ranks start together)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _time_pair(first: Callable[[], object], second: Callable[[], object], iters: int) -> tuple[float, float]:
    """Medians of ``first`` and ``second``, run alternately so load noise hits both alike."""
    for _ in range(2):
        first(), second()
    a, b = [], []
    for _ in range(iters):
        a.append(_run_once(first))
        b.append(_run_once(second))
    return statistics.median(a), statistics.median(b)


def _scenarios(rows: int, cols: int) -> list[tuple[str, str, Callable[[], object], Callable[[], object]]]:
    from ragged_dtensor import RaggedShard, distribute_tensor, redistribute_many

    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    ragged = RaggedShard((0,), UNITS)
    other = RaggedShard((0,), (1, 3, 0, 4))
    one_hot = RaggedShard((0,), ONE_HOT)
    rs = distribute_tensor(full, mesh, [ragged])
    rep = distribute_tensor(full, mesh, [Replicate()])
    s0 = distribute_tensor(full, mesh, [Shard(0)])
    s1 = distribute_tensor(full, mesh, [Shard(1)])
    partial = DTensor.from_local(full, mesh, [Partial()], run_check=False)
    matrices = [torch.randn(rows // 8, cols, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    rs_many = [distribute_tensor(m, mesh, [ragged]) for m in matrices]
    s0_many = [distribute_tensor(m, mesh, [Shard(0)]) for m in matrices]
    owners = [RaggedShard((0,), [int(r == i % WORLD) for r in range(WORLD)]) for i in range(8)]
    return [
        ("RaggedShard -> Replicate", "Shard(0) -> Replicate",
         lambda: rs.redistribute(mesh, [Replicate()]), lambda: s0.redistribute(mesh, [Replicate()])),
        ("Replicate -> RaggedShard", "Replicate -> Shard(0)",
         lambda: rep.redistribute(mesh, [ragged]), lambda: rep.redistribute(mesh, [Shard(0)])),
        ("RaggedShard -> RaggedShard", "Shard(0) -> Shard(1)",
         lambda: rs.redistribute(mesh, [other]), lambda: s0.redistribute(mesh, [Shard(1)])),
        ("RaggedShard -> Shard(0)", "Shard(1) -> Shard(0)",
         lambda: rs.redistribute(mesh, [Shard(0)]), lambda: s1.redistribute(mesh, [Shard(0)])),
        ("RaggedShard -> Shard(1)", "Shard(0) -> Shard(1)",
         lambda: rs.redistribute(mesh, [Shard(1)]), lambda: s0.redistribute(mesh, [Shard(1)])),
        ("Shard(1) -> RaggedShard", "Shard(1) -> Shard(0)",
         lambda: s1.redistribute(mesh, [ragged]), lambda: s1.redistribute(mesh, [Shard(0)])),
        ("RaggedShard -> one-hot", "Shard(0) -> Replicate",
         lambda: rs.redistribute(mesh, [one_hot]), lambda: s0.redistribute(mesh, [Replicate()])),
        ("Partial -> RaggedShard", "Partial -> Shard(0)",
         lambda: partial.redistribute(mesh, [ragged]), lambda: partial.redistribute(mesh, [Shard(0)])),
        ("redistribute_many: 8 matrices -> one-hot owners", "8 x Shard(0) -> Replicate",
         lambda: redistribute_many(rs_many, [[o] for o in owners]),
         lambda: [t.redistribute(mesh, [Replicate()]) for t in s0_many]),
    ]


def _measure(rows: int, cols: int, iters: int) -> list[dict[str, Any]]:
    """Every scenario on this rank, ragged and torch alternated."""
    rows_out = []
    for ragged_name, torch_name, ragged_fn, torch_fn in _scenarios(rows, cols):
        ragged_s, torch_s = _time_pair(ragged_fn, torch_fn, iters)
        rows_out.append({"ragged": ragged_name, "torch": torch_name, "ragged_ms": ragged_s * 1e3,
                         "torch_ms": torch_s * 1e3, "ratio": ragged_s / torch_s})
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    results = run_on_gloo_ranks(_measure, WORLD, args.rows, args.cols, args.iters)
    print(f"{WORLD} gloo ranks, fp32 [{args.rows}, {args.cols}], units {UNITS}, median of {args.iters}")
    print(f"{'ragged':50s} {'ms':>8s}   {'torch equivalent':28s} {'ms':>8s}  ratio")
    for row in results:
        print(f"{row['ragged']:50s} {row['ragged_ms']:8.2f}   {row['torch']:28s} "
              f"{row['torch_ms']:8.2f}  {row['ratio']:5.2f}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "world_size": WORLD, "shape": [args.rows, args.cols], "dtype": "float32", "units": UNITS,
        "iters": args.iters, "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "rows": results,
    }, indent=2) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
