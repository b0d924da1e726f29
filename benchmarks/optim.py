"""Muon step time on 4 gloo ranks: owner-based (ours) vs torch.optim.Muon on FSDP2 DTensors vs
every rank doing every matrix; plus the owner load imbalance.

A LLaMA-like set of hidden matrices (attention q/k/v/o and the SwiGLU MLP of every layer) is
sharded three ways and stepped with Newton-Schulz in bf16:

* ``ours``: :class:`block_optim.Muon` on RaggedShard parameters planned by
  :func:`layout_planner.plan` with :meth:`block_optim.Muon.unit_policy` (one all-to-all each
  way per step, each matrix orthogonalized once, on its owner);
* ``fsdp2_torch_muon``: ``torch.optim.Muon`` on ``Shard(0)`` DTensors, as FSDP2 leaves them
  (Newton-Schulz runs as distributed matmuls);
* ``replicated``: ``torch.optim.Muon`` on plain full tensors on every rank (no communication,
  every rank computes every matrix).

Usage: ``python benchmarks/optim.py [--layers 2] [--dim 256] [--steps 3]``. Writes
``benchmarks/results/optim_muon.json``. One thread per rank; CPU timings on a shared machine
are noisy: compare ratios from the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gloo_ranks import run_on_gloo_ranks

WORLD = 4


def llama_matrices(layers: int, dim: int) -> dict[str, tuple[int, int]]:
    """Hidden matrices of a LLaMA-like model (SwiGLU hidden size 8/3 * dim, rounded to 32)."""
    hidden = (8 * dim // 3 + 31) // 32 * 32
    shapes = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"layers.{i}.attn.w{name}"] = (dim, dim)
        shapes[f"layers.{i}.mlp.w1"] = (hidden, dim)
        shapes[f"layers.{i}.mlp.w3"] = (hidden, dim)
        shapes[f"layers.{i}.mlp.w2"] = (dim, hidden)
    return shapes


def _time_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor],
                steps: int) -> list[float]:
    times = []
    for _ in range(steps + 1):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:]  # the first step builds plans and state


def _progress(rank: int, name: str, results: dict[str, list[float]]) -> None:
    if rank == 0:
        print(f"rank 0 {name}: {[round(t * 1e3, 1) for t in results[name]]} ms", flush=True)


def _measure(layers: int, dim: int, steps: int) -> dict[str, Any] | None:
    """Every variant on this rank; rank 0 returns the slowest rank's step times."""
    rank = dist.get_rank()
    from layout_planner import TensorSpec, plan
    from ragged_dtensor import RaggedShard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from block_optim import Muon
    from block_optim.matrix_owners import imbalance
    from block_optim.newton_schulz import newton_schulz_flops

    mesh = init_device_mesh("cpu", (WORLD,))
    shapes = llama_matrices(layers, dim)
    gen = torch.Generator().manual_seed(0)
    fulls = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    policy = Muon.unit_policy()
    layout = plan([TensorSpec(n, t.numel(), policy(n, t), tuple(t.shape)) for n, t in fulls.items()], WORLD)

    def ragged(t: torch.Tensor, name: str) -> DTensor:
        counts = [b - a for a, b in (layout.local_range(name, r) for r in range(WORLD))]
        placement = RaggedShard.from_element_counts(tuple(t.shape), counts)
        lo, hi = placement.flat_range(tuple(t.shape), rank)
        return DTensor.from_local(t.reshape(-1)[lo:hi].clone(), mesh, [placement], shape=t.shape,
                                  stride=t.stride(), run_check=False)

    results: dict[str, list[float]] = {}
    ours = [torch.nn.Parameter(ragged(t, n)) for n, t in fulls.items()]
    opt = Muon(list(zip(shapes, ours, strict=True)), lr=0.02)
    results["ours"] = _time_steps(opt, ours, [ragged(g, n) for n, g in grads.items()], steps)
    _progress(rank, "ours", results)
    plan_ = opt._scheduler.plan_for(ours, list(shapes))
    costs = [newton_schulz_flops(p.rows, p.cols) for p in plan_.pieces]
    loads = plan_.load(costs)
    cut = sum(plan_.is_cut(i) for i in range(len(plan_.pieces)))

    fsdp = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in fulls.values()]
    opt = torch.optim.Muon(fsdp, lr=0.02)
    results["fsdp2_torch_muon"] = _time_steps(
        opt, fsdp, [distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None) for g in grads.values()], steps)
    _progress(rank, "fsdp2_torch_muon", results)

    plain = [torch.nn.Parameter(t.clone()) for t in fulls.values()]
    opt = torch.optim.Muon(plain, lr=0.02)
    results["replicated"] = _time_steps(opt, plain, list(grads.values()), steps)

    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank != 0:
        return None
    # A step takes as long as its slowest rank.
    per_step = {k: [max(r[k][s] for r in gathered) for s in range(steps)] for k in results}
    return {
        "per_step_s": per_step, "loads_flops": loads, "imbalance_max_over_mean": imbalance(loads),
        "matrices": len(plan_.pieces), "cut_matrices": cut, "padding_elements": layout.padding,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    raw = run_on_gloo_ranks(_measure, WORLD, args.layers, args.dim, args.steps)
    median = {k: statistics.median(v) for k, v in raw["per_step_s"].items()}
    result = {
        "benchmark": "Muon optimizer step, 4 gloo ranks, 1 thread each, Newton-Schulz in bf16",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"layers": args.layers, "dim": args.dim, "matrices": raw["matrices"],
                  "params": sum(a * b for a, b in llama_matrices(args.layers, args.dim).values())},
        "median_step_s": median,
        "speedup_vs_fsdp2_torch_muon": median["fsdp2_torch_muon"] / median["ours"],
        "speedup_vs_replicated": median["replicated"] / median["ours"],
        "owner_imbalance_max_over_mean": raw["imbalance_max_over_mean"],
        "owner_loads_gflop": [x / 1e9 for x in raw["loads_flops"]],
        "cut_matrices": raw["cut_matrices"],
        "planner_padding_elements": raw["padding_elements"],
        "per_step_s": raw["per_step_s"],
        "note": "CPU timings on a shared 2-core machine: noisy; compare ratios within one run.",
    }
    print(f"{'variant':<20}{'median step (ms)':>18}{'vs ours':>10}")
    for k, v in median.items():
        print(f"{k:<20}{v * 1e3:>18.1f}{v / median['ours']:>10.2f}x")
    print(f"owner load imbalance (max/mean NS flops): {raw['imbalance_max_over_mean']:.3f}; "
          f"{raw['cut_matrices']} of {raw['matrices']} matrices cut")
    path = Path(__file__).parent / "results" / "optim_muon.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
