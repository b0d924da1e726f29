"""DBuffer vs FSDP2: all-gather + reduce-scatter of one LLaMA-like layer on 4 gloo ranks.

Both sides move the same tensors through the same gloo collectives; they differ in what they
copy around them. FSDP2 is driven through its own internals
(``torch.distributed.fsdp._fully_shard._fsdp_collectives``): ``foreach_all_gather`` (copy-in
of every shard into the all-gather input), ``foreach_all_gather_copy_out``
(``split_with_sizes_copy`` into per-parameter tensors), then freeing the unsharded
parameters, and ``foreach_reduce`` (``chunk_cat`` of the gradients into the reduce-scatter
input, new sharded gradients). DBuffer runs ``all_gather`` / ``free_unsharded`` /
``reduce_scatter`` on its flat buffers in place.

Reported per precision mode (fp32; bf16 compute with fp32 reduce):

* time: the median over iterations of the slowest rank's wall time for each phase;
* copies: bytes written by copy ops each side issues (from ``torch.profiler``), apart from the
  copies gloo makes internally (it stages every collective through temporaries; the same
  for both sides), which are reported separately.

On a machine with CUDA it also measures the fused kernels' achieved bandwidth (give
``--peak-gbps`` for the fraction of the device's peak).

Run: ``python benchmarks/dbuffer.py [--iters N] [--dim D] [--hidden H]``; writes
``benchmarks/results/dbuffer.json``. Timings on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This script is named like the package it measures: its folder goes last on the import path,
# so `import dbuffer` finds the package while the shared benchmark helpers stay importable.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gloo_ranks import run_on_gloo_ranks  # noqa: E402
from torch import nn  # noqa: E402

WORLD_SIZE = 4
RESULTS = Path(__file__).resolve().parent / "results" / "dbuffer.json"


def layer_shapes(dim: int, hidden: int, kv_dim: int) -> dict[str, tuple[int, ...]]:
    """One LLaMA decoder layer: GQA attention, SwiGLU MLP, two RMSNorm weights."""
    return {
        "attn_norm": (dim,),
        "wq": (dim, dim), "wk": (kv_dim, dim), "wv": (kv_dim, dim), "wo": (dim, dim),
        "mlp_norm": (dim,),
        "w_gate": (hidden, dim), "w_up": (hidden, dim), "w_down": (dim, hidden),
    }


class _Layer(nn.Module):
    """Holds the layer's parameters for FSDP2 (its forward is never run)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t.clone()))


def _full_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _grads(shapes: dict[str, tuple[int, ...]], rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


# ----------------------------------------------------------------------------- DBuffer side
def _dbuffer_side(shapes: dict[str, tuple[int, ...]], compute: torch.dtype | None) -> Any:
    from layout_planner import TensorSpec, plan

    from dbuffer import DBuffer

    specs = [TensorSpec(n, int(torch.Size(s).numel()), s[-1] if len(s) > 1 else 1, s)
             for n, s in shapes.items()]
    p = plan(specs, WORLD_SIZE, align=4)
    buf = DBuffer.from_tensors(_full_tensors(shapes), p, compute_dtype=compute,
                               reduce_dtype=torch.float32)
    for name, g in _grads(shapes, dist.get_rank(), buf.compute_dtype).items():
        buf.grad_view(name).copy_(g)  # stands in for autograd writing the gradient views

    def all_gather() -> None:
        buf.all_gather()
        buf.free_unsharded()

    def reduce_scatter() -> None:
        buf.free_sharded_grad()  # zero_grad(set_to_none=True): overwrite, no accumulation
        buf.reduce_scatter("avg")

    return all_gather, reduce_scatter, p.padding


# ------------------------------------------------------------------------------- FSDP2 side
def _fsdp2_side(shapes: dict[str, tuple[int, ...]], compute: torch.dtype | None) -> Any:
    from fsdp2_scoped import ScopedAllGather, ScopedReduceScatter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        foreach_all_gather,
        foreach_all_gather_copy_out,
        foreach_reduce,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    module = _Layer(_full_tensors(shapes))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    state = module._get_fsdp_state()
    state._lazy_init()
    group = state._fsdp_param_group
    params = group.fsdp_params
    ag_comm, rs_comm = ScopedAllGather(), ScopedReduceScatter()
    grad_dtype = compute or torch.float32
    grads = _grads(shapes, dist.get_rank(), grad_dtype)
    unsharded_grads = [grads[name] for name in (p._param_fqn for p in params)]

    def all_gather() -> None:
        result = foreach_all_gather(
            params, group._all_gather_process_group, False,
            *group.comm_ctx.get_all_gather_streams(False, TrainingState.FORWARD),
            group.device, ag_comm)
        foreach_all_gather_copy_out(result, params, group._all_gather_process_group)
        for p in params:
            p.init_unsharded_param()
        for p in params:
            p.free_unsharded_param()

    def reduce_scatter() -> None:
        for p in params:
            p.sharded_param.grad = None
        foreach_reduce(
            params, list(unsharded_grads), group._reduce_scatter_process_group,
            group.comm_ctx.reduce_scatter_stream, rs_comm, group._orig_dtype,
            group._reduce_dtype, group.device, group.gradient_divide_factor, None,
            group.comm_ctx.all_reduce_stream, True, None, None)

    return all_gather, reduce_scatter, None


# ------------------------------------------------------------------------------ measurement
def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) * 1e3


def _copies(fn: Any) -> dict[str, Any]:
    from dbuffer.profiling import copies, summarize

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    found = copies(prof.events())
    summary = summarize(found)
    copy_events = [e for e in prof.events() if e.name in ("aten::copy_", "aten::cat")]
    summary["issued"]["ops"] = sorted({c.ancestors[-1] if c.ancestors else c.name
                                        for c in found if not c.backend})
    summary["profiled_copy_cpu_ms"] = sum(e.self_cpu_time_total for e in copy_events) / 1e3
    return summary


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides on this rank, interleaved; every rank returns its report (rank 0's is kept)."""
    shapes = layer_shapes(args.dim, args.hidden, args.dim // 4)
    report: dict[str, Any] = {}
    for mode, compute in (("fp32", None), ("bf16_compute_fp32_reduce", torch.bfloat16)):
        sides = {"dbuffer": _dbuffer_side(shapes, compute), "fsdp2": _fsdp2_side(shapes, compute)}
        times: dict[str, dict[str, list[float]]] = {
            s: {"all_gather": [], "reduce_scatter": []} for s in sides}
        for it in range(args.warmup + args.iters):
            # interleaved, in alternating order: both sides see the same noise and neither
            # always runs right after the other
            order = list(sides.items()) if it % 2 else list(reversed(sides.items()))
            for side, (ag, rs, _) in order:
                t_ag, t_rs = _timed(ag), _timed(rs)
                if it >= args.warmup:
                    times[side]["all_gather"].append(t_ag)
                    times[side]["reduce_scatter"].append(t_rs)
        entry: dict[str, Any] = {}
        for side, (ag, rs, padding) in sides.items():
            med = {k: statistics.median(v) for k, v in times[side].items()}
            best = {k: min(v) for k, v in times[side].items()}
            entry[side] = {
                "all_gather_ms": med["all_gather"], "reduce_scatter_ms": med["reduce_scatter"],
                "total_ms": med["all_gather"] + med["reduce_scatter"],
                "min_all_gather_ms": best["all_gather"],
                "min_reduce_scatter_ms": best["reduce_scatter"],
                "copies": {"all_gather": _copies(ag), "reduce_scatter": _copies(rs)},
            }
            if padding is not None:
                entry[side]["plan_padding_elements"] = padding
        d, f = entry["dbuffer"], entry["fsdp2"]
        entry["ratios"] = {
            "time_fsdp2_over_dbuffer": f["total_ms"] / d["total_ms"],
            "all_gather_time_fsdp2_over_dbuffer": f["all_gather_ms"] / d["all_gather_ms"],
            "reduce_scatter_time_fsdp2_over_dbuffer": f["reduce_scatter_ms"] / d["reduce_scatter_ms"],
        }
        report[mode] = entry
    return report


def gpu_kernel_bandwidth(numel: int, peak_gbps: float | None) -> dict[str, Any]:
    """Achieved bandwidth of each fused kernel on the current CUDA device (Triton path).

    Bytes moved per launch follow each kernel's docstring; ``peak_gbps`` (the device's DRAM
    bandwidth, e.g. 4800 for an H200) turns them into a fraction of peak.
    """
    from dbuffer import kernels

    f32, b16 = torch.float32, torch.bfloat16
    dst32 = torch.empty(numel, dtype=f32, device="cuda")
    src16 = torch.randn(numel, device="cuda").to(b16)
    cases = {
        "zero_ fp32": (lambda: kernels.zero_(dst32), 4),
        "scale_ fp32": (lambda: kernels.scale_(dst32, 0.5), 8),
        "copy_cast_ bf16->fp32": (lambda: kernels.copy_cast_(dst32, src16, 0.25), 6),
        "add_ fp32 += bf16": (lambda: kernels.add_(dst32, src16, 0.5), 10),
        "squared_norm bf16": (lambda: kernels.squared_norm(src16), 2),
    }
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "numel": numel}
    for name, (fn, bytes_per_element) in cases.items():
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 20
        gbps = numel * bytes_per_element / seconds / 1e9
        out[name] = {"ms": seconds * 1e3, "GB_per_s": gbps,
                     "fraction_of_peak": gbps / peak_gbps if peak_gbps else None}
    return out


def _issued(entry: dict[str, Any]) -> tuple[int, int]:
    c = entry["copies"]
    return (c["all_gather"]["issued"]["bytes"] + c["reduce_scatter"]["issued"]["bytes"],
            c["all_gather"]["backend"]["bytes"] + c["reduce_scatter"]["backend"]["bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--gpu-numel", type=int, default=1 << 28,
                        help="buffer size for the GPU kernel bandwidth part (CUDA only)")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the GPU's peak DRAM bandwidth in GB/s, for the fraction of peak")
    args = parser.parse_args()

    # glibc returns freed multi-MB blocks to the OS (mmap / heap trimming), so a fresh
    # temporary page-faults on first touch or not depending on what else happens to be
    # allocated: profiles showed 12 MB casts and gloo's clone 15x slower on one side for that
    # reason alone. Keep freed memory in the heap on both sides, as the CUDA caching
    # allocator does on GPUs (the ranks inherit these settings).
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ.setdefault(var, str(1 << 30))
    report = run_on_gloo_ranks(_measure, WORLD_SIZE, args)

    shapes = layer_shapes(args.dim, args.hidden, args.dim // 4)
    numel = sum(int(torch.Size(s).numel()) for s in shapes.values())
    result = {
        "benchmark": "dbuffer all-gather + reduce-scatter vs FSDP2 foreach_all_gather + "
                     "copy-out + foreach_reduce",
        "world_size": WORLD_SIZE, "backend": "gloo (CPU, 1 thread per rank)",
        "layer": {"dim": args.dim, "hidden": args.hidden, "kv_dim": args.dim // 4,
                  "params": numel},
        "iters": args.iters, "warmup": args.warmup,
        "malloc": {v: os.environ[v] for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")},
        "note": "times: median (and min) over iterations of the slowest rank, ms; copy bytes: rank 0, "
                "one iteration; 'issued' = copies the side itself makes, 'backend' = copies "
                "inside gloo. Shared 2-core machine: timings are noisy.",
        "modes": report,
    }
    if torch.cuda.is_available():
        result["gpu_kernels"] = gpu_kernel_bandwidth(args.gpu_numel, args.peak_gbps)
        for name, row in result["gpu_kernels"].items():
            if isinstance(row, dict):
                print(f"GPU {name}: {row['GB_per_s']:.0f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"layer: dim {args.dim}, hidden {args.hidden}, {numel / 1e6:.2f}M params, "
          f"{WORLD_SIZE} gloo ranks")
    header = f"{'mode':28s} {'side':8s} {'AG ms':>8s} {'RS ms':>8s} {'total':>8s} " \
             f"{'issued copy MB':>15s} {'gloo copy MB':>13s}"
    print(header)
    for mode, entry in report.items():
        for side in ("fsdp2", "dbuffer"):
            e = entry[side]
            issued, backend = _issued(e)
            print(f"{mode:28s} {side:8s} {e['all_gather_ms']:8.1f} {e['reduce_scatter_ms']:8.1f} "
                  f"{e['total_ms']:8.1f} {issued / 1e6:15.2f} {backend / 1e6:13.2f}")
        r = entry["ratios"]
        print(f"{mode:28s} ratio FSDP2/DBuffer time: total {r['time_fsdp2_over_dbuffer']:.2f}x, "
              f"AG {r['all_gather_time_fsdp2_over_dbuffer']:.2f}x, "
              f"RS {r['reduce_scatter_time_fsdp2_over_dbuffer']:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
