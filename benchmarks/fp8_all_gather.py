"""Block-wise FP8 all-gather vs bf16: bytes, gather time, quantize/dequantize time, train steps.

On ``--world-sizes`` gloo ranks (one thread each), in one run:

* one layer (a LLaMA-style block's Linear weights and norms, ``--dim`` / ``--ffn``): the bytes
  one all-gather delivers to every rank (from a collective log) and its median time, for
  fsdp with ``quantize_all_gather=BlockwiseFP8()``, fsdp with bf16 all-gather, and FSDP2 with
  bf16 all-gather; the time of one quantization of the rank's shard and of one
  dequantization of the gathered bytes (torch path on CPU);
* the train step of the main job's decoder (``examples.train.model.Decoder``, AdamW, bf16
  compute / fp32 reduction), FP8 all-gather vs bf16 all-gather (ours) vs FSDP2 bf16:
  median step time (slowest rank).

Ratios FP8 / bf16 are computed per world size. Where ``torchao`` imports (see
``TORCHAO_INSTALL``), FSDP2 + torchao's tensorwise FP8 all-gather is measured too. Timings on a shared 2-core CPU are noisy and are not GPU figures;
the bytes are exact.

Run: ``python benchmarks/fp8_all_gather.py [--world-sizes 2 4] [--iters N] [--steps N]``;
writes ``benchmarks/results/fp8_all_gather.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# benchmarks/dbuffer.py would shadow the dbuffer package: this folder goes last
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE), str(HERE.parent)]

from gloo_ranks import run_on_gloo_ranks  # noqa: E402

TORCHAO_INSTALL = ("pip install --no-deps --target /tmp/taolib torchao==0.18.0 (its metadata "
                   "requires no torch, so nothing else is installed), then "
                   "PYTHONPATH=/tmp/taolib:$PYTHONPATH")


def _torchao() -> Any:
    """torchao's float8 training module, or ``None`` when it is not importable."""
    try:
        from torchao import float8
    except ImportError:
        return None
    return float8


def _to_torchao_fp8(model: Any) -> None:
    """FSDP2 + torchao's tensorwise FP8 (all-gather in FP8, amax all-reduce), blocks' Linear
    layers only (as fsdp's recipe: the output head stays in bf16)."""
    float8 = _torchao()
    float8.convert_to_float8_training(
        model, config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        module_filter_fn=lambda module, fqn: fqn != "output")


def _layer(dim: int, ffn: int) -> Any:
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.Parameter(torch.ones(dim))
            for name in ("wq", "wk", "wv", "wo"):
                setattr(self, name, nn.Linear(dim, dim, bias=False))
            self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)

    torch.manual_seed(0)
    return Layer()


def _timed(fn: Any, iters: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _layer_case(dim: int, ffn: int, iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import fsdp
    from dbuffer.kernels.fp8 import dequantize_tiles

    from tests.dbuffer.collective_log import record_collectives

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out: dict[str, Any] = {}
    for label, quantize in (("fp8", fsdp.BlockwiseFP8()), ("bf16", None)):
        model = _layer(dim, ffn)
        fsdp.fully_shard(model, mesh=mesh, mp_policy=mp, quantize_all_gather=quantize)
        group = model._get_fsdp_state().groups[0]

        def gather(model: Any = model) -> None:
            model.unshard()
            model.reshard()

        with record_collectives() as calls:
            gather()
        entry = {"bytes_per_gather": sum(c.output_bytes for c in calls),
                 "collectives_per_gather": len(calls), "gather_ms": _timed(gather, iters)}
        if quantize is not None:
            gathers = list(group.quantizer.gathers.values())

            def quantize_once() -> None:
                for g in gathers:
                    g.invalidate()
                    g.local_segment()

            packed = [torch.zeros(g.wire_bytes, dtype=torch.uint8) for g in gathers]
            outs = [torch.empty(g.buffer.world_size * g.buffer.shard_size, dtype=torch.bfloat16)
                    for g in gathers]

            def dequantize_once() -> None:
                for g, p, o in zip(gathers, packed, outs):
                    dequantize_tiles(p, o, g._dequantize_table, g.fmt)

            entry["quantize_ms"] = _timed(quantize_once, iters)
            entry["dequantize_ms"] = _timed(dequantize_once, iters)
        out[label] = entry
    for label in ("fsdp2_bf16", "fsdp2_torchao_fp8"):
        if label == "fsdp2_torchao_fp8" and _torchao() is None:
            continue
        model = _layer(dim, ffn)
        if label == "fsdp2_torchao_fp8":
            _to_torchao_fp8(model)
        fsdp2_fully_shard(model, mesh=mesh, mp_policy=mp)

        def gather2(model: Any = model) -> None:
            model.unshard()
            model.reshard()

        with record_collectives() as calls:
            gather2()
        out[label] = {"bytes_per_gather": sum(c.output_bytes for c in calls),
                      "collectives_per_gather": len(calls),
                      "collectives": sorted({c.name for c in calls}),
                      "gather_ms": _timed(gather2, iters)}
    return out


def _train_case(steps: int, warmup: int, dim: int, layers: int, seq: int, batch: int
                ) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import fsdp
    from examples.train.model import Decoder, ModelConfig

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(256, (batch, seq + 1), generator=g)
    result = {}
    labels = ["fp8", "bf16", "fsdp2_bf16"] + (["fsdp2_torchao_fp8"] if _torchao() else [])
    for label in labels:
        torch.manual_seed(0)
        model = Decoder(ModelConfig(dim=dim, n_layers=layers, n_heads=4, ffn_dim=dim * 11 // 4,
                                    max_seq_len=seq))
        if label.startswith("fsdp2"):
            if label == "fsdp2_torchao_fp8":
                _to_torchao_fp8(model)
            for block in model.layers:
                fsdp2_fully_shard(block, mesh=mesh, mp_policy=mp)
            fsdp2_fully_shard(model, mesh=mesh, mp_policy=mp)
        else:
            quantize = fsdp.BlockwiseFP8() if label == "fp8" else None
            for block in model.layers:
                fsdp.fully_shard(block, mesh=mesh, mp_policy=mp, quantize_all_gather=quantize)
            fsdp.fully_shard(model, mesh=mesh, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> None:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        result[label] = statistics.median(times) * 1e3
    return result


def _torchao_version() -> str:
    import torchao

    return torchao.__version__


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--model-dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "fp8_all_gather.json")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/fp8_all_gather.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "torchao": ("FSDP2 + torchao tensorwise FP8 all-gather measured (torchao "
                    f"{_torchao_version()}; its Float8Linear also runs FP8 matmuls, emulated "
                    "by torch._scaled_mm on CPU, so its step time is not a like-for-like "
                    "compute comparison)" if _torchao() else
                    f"not installed, not measured; to add it: {TORCHAO_INSTALL}"),
        "worlds": {}}
    for world in args.world_sizes:
        layer = run_on_gloo_ranks(_layer_case, world, args.dim, args.ffn, args.iters)
        train = run_on_gloo_ranks(_train_case, world, args.steps, args.warmup, args.model_dim,
                                  args.layers, args.seq, args.batch_per_rank)
        report["worlds"][str(world)] = {
            "layer": layer, "train_step_ms": train,
            "ratios": {
                "bytes_fp8_over_bf16": _ratio(layer["fp8"]["bytes_per_gather"],
                                              layer["bf16"]["bytes_per_gather"]),
                "bytes_fp8_over_fsdp2_bf16": _ratio(layer["fp8"]["bytes_per_gather"],
                                                    layer["fsdp2_bf16"]["bytes_per_gather"]),
                "gather_time_fp8_over_bf16": _ratio(layer["fp8"]["gather_ms"],
                                                    layer["bf16"]["gather_ms"]),
                "train_step_fp8_over_bf16": _ratio(train["fp8"], train["bf16"]),
                "train_step_fp8_over_fsdp2_bf16": _ratio(train["fp8"], train["fsdp2_bf16"]),
            }}
        if "fsdp2_torchao_fp8" in layer:
            report["worlds"][str(world)]["ratios"]["bytes_fp8_over_fsdp2_torchao_fp8"] = _ratio(
                layer["fp8"]["bytes_per_gather"], layer["fsdp2_torchao_fp8"]["bytes_per_gather"])
        print(json.dumps({world: report["worlds"][str(world)]["ratios"]}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
