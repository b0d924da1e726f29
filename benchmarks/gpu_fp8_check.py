"""Block-wise FP8 on a CUDA GPU: kernels bit for bit, block-scaled matmul, NCCL all-gather.

Prints one JSON line (and writes it to ``--out`` when given):

* ``kernels``: the Triton quantize/dequantize kernels (compiled, not interpreted) against the
  torch path on the same CUDA tensors, bit for bit: FP8 bytes (NaN bytes compared as NaN),
  fp32 scales, and dequantized fp32 / bf16 / fp16 values, for shapes that are not multiples
  of 128 and aligned ones, both scale modes and E5M2; plus each kernel's time and bandwidth
  on a 4096x14336 weight;
* ``scaled_mm``: ``torch.nn.functional.scaled_mm`` with 128x128 weight scales and 1x128
  activation scales (``ScalingType.BlockWise128x128`` / ``BlockWise1x128``; SM90 and cuBLASLt
  >= 12.9) against dequantize-then-matmul in fp32: relative error, or why it did not run;
* ``all_gather``: fsdp's all-gather of one LLaMA-8B-sized block on NCCL at world size 1,
  FP8 (``quantize_all_gather=BlockwiseFP8()``) vs bf16: bytes and median time
  (``--torch-2.11-shim``: on torch 2.11, with :mod:`torch_211_shim`).

Run on a machine with a GPU: ``python benchmarks/gpu_fp8_check.py [--out FILE]``
(well under two minutes on an H100). Without CUDA it prints ``{"skipped": ...}``.
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

HERE = Path(__file__).resolve().parent
# benchmarks/dbuffer.py would shadow the dbuffer package: this folder goes last
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE.parent),
                                                                       str(HERE)]

import torch  # noqa: E402

from dbuffer.blockwise_fp8 import BlockwiseFormat, dequantize_blockwise, quantize_blockwise  # noqa: E402
from dbuffer.kernels.fp8 import TileRun, TileTable, dequantize_tiles, quantize_tiles  # noqa: E402

SHAPES = [(1, 129, 257), (1, 1000, 1000), (1, 200, 96), (3, 384, 200), (1, 256, 128)]
FORMATS = {"e4m3": BlockwiseFormat(), "e4m3_pow2": BlockwiseFormat(power_of_two_scales=True),
           "e5m2": BlockwiseFormat(dtype=torch.float8_e5m2)}


def _table(shapes: list[tuple[int, int, int]], fmt: BlockwiseFormat) -> tuple[TileTable, int, int, int]:
    scales = sum(TileRun(0, 0, 0, *s).scales(fmt.block) for s in shapes)
    runs, values, q, s = [], 0, 4 * scales, 0
    for shape in shapes:
        run = TileRun(values, q, s, *shape)
        runs.append(run)
        values, q, s = values + run.numel, q + run.numel, s + run.scales(fmt.block)
    return TileTable(tuple(runs), fmt.block), values, q + (-q) % 4, 4 * scales


def _source(n: int, device: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    mags = torch.logspace(-35, 4, n)[torch.randperm(n, generator=g)]
    x = torch.randn(n, generator=g) * mags
    x[5] = float("nan")
    x[129 * 257 + 7] = float("inf")
    x[1000:1000 + 300] = 0
    return x.to(device)


def _cuda_ms(fn: Any, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check_kernels() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, fmt in FORMATS.items():
        table, numel, nbytes, scale_bytes = _table(SHAPES, fmt)
        src = _source(numel, "cuda")
        ref, ours = (torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
        quantize_tiles(src, ref, table, fmt, backend="torch")
        quantize_tiles(src, ours, table, fmt, backend="triton")
        # the packed buffer: fp32 scales first, then FP8 bytes; NaN bytes compare as NaN (an
        # FP8 NaN's sign, like an fp32 NaN's, carries no value)
        q_ref, q_ours = ref[scale_bytes:], ours[scale_bytes:]
        nan = (q_ref & 0x7F) == 0x7F
        s_ref, s_ours = ref[:scale_bytes].view(torch.float32), ours[:scale_bytes].view(torch.float32)
        result = {
            "bytes_equal": bool(torch.equal(q_ref[~nan], q_ours[~nan])
                                and bool(((q_ours[nan] & 0x7F) == 0x7F).all())),
            "bytes_differing": int((q_ref[~nan] != q_ours[~nan]).sum()),
            "scales_equal": bool(torch.equal(s_ref.nan_to_num(7.0), s_ours.nan_to_num(7.0))),
        }
        for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16),
                            (torch.float16, torch.int16)):
            a = torch.zeros(numel, dtype=dtype, device="cuda")
            b = torch.zeros_like(a)
            dequantize_tiles(ref, a, table, fmt, backend="torch")
            dequantize_tiles(ref, b, table, fmt, backend="triton")
            keep = ~a.isnan()
            result[f"dequantize_{str(dtype).split('.')[-1]}_equal"] = bool(
                torch.equal(a.isnan(), b.isnan()) and torch.equal(a.view(bits)[keep], b.view(bits)[keep]))
        out[label] = result
    fmt = BlockwiseFormat()
    table, numel, nbytes, _ = _table([(1, 4096, 14336)], fmt)
    src = torch.randn(numel, device="cuda")
    packed = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    values = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    timing = {}
    for backend in ("triton", "torch"):
        q_ms = _cuda_ms(lambda: quantize_tiles(src, packed, table, fmt, backend=backend))
        d_ms = _cuda_ms(lambda: dequantize_tiles(packed, values, table, fmt, backend=backend))
        timing[backend] = {"quantize_ms": q_ms, "quantize_GBps": numel * 5 / q_ms / 1e6,
                           "dequantize_ms": d_ms, "dequantize_GBps": numel * 3 / d_ms / 1e6}
    out["timing_4096x14336"] = timing
    return out


def check_scaled_mm() -> dict[str, Any]:
    import torch.nn.functional as F

    M, K, N = 256, 1024, 768
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda")
    w = torch.randn(N, K, device="cuda") * 0.05
    qw, sw = quantize_blockwise(w)                      # 128x128 tiles: sw [N/128, K/128]
    # activations: 1x128 blocks = tiles of one row, by quantizing each row as its own matrix
    qx, sx = quantize_blockwise(x.view(M, 1, K))
    qx, sx = qx.view(M, K), sx.view(M, K // 128)
    reference = dequantize_blockwise(qx.view(M, 1, K), sx.view(M, 1, K // 128)).view(M, K) \
        @ dequantize_blockwise(qw, sw).t()
    try:
        l4 = -(-(K // 128) // 4) * 4
        scale_b = torch.zeros(N // 128, l4, device="cuda")
        scale_b[:, : K // 128] = sw
        got = F.scaled_mm(qx, qw.t(), [sx.t().contiguous().t()], [F.ScalingType.BlockWise1x128],
                          [scale_b.t()], [F.ScalingType.BlockWise128x128],
                          [F.SwizzleType.NO_SWIZZLE], [F.SwizzleType.NO_SWIZZLE],
                          None, torch.bfloat16)
    except Exception as error:  # noqa: BLE001 - reported, the other checks still run
        return {"ran": False, "error": f"{type(error).__name__}: {error}"[:400]}
    err = (got.float() - reference).abs().max() / reference.abs().max()
    return {"ran": True, "shape": [M, K, N], "max_rel_error": float(err),
            "close": bool(err < 1e-2)}


def check_all_gather(shim: bool = False, iters: int = 10) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    if shim:
        import torch_211_shim

        torch_211_shim.install()
    import fsdp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dim, ffn = 4096, 14336
    out: dict[str, Any] = {"model": f"one block: 4 x {dim}x{dim}, 3 x {ffn}x{dim} Linear weights"}
    for label, quantize in (("fp8", fsdp.BlockwiseFP8()), ("bf16", None)):
        with torch.device("cuda"):
            block = nn.ModuleDict({n: nn.Linear(dim, dim, bias=False) for n in ("q", "k", "v", "o")})
            for n in ("w1", "w3"):
                block[n] = nn.Linear(dim, ffn, bias=False)
            block["w2"] = nn.Linear(ffn, dim, bias=False)
        holder = nn.Sequential(block)
        fsdp.fully_shard(holder, mesh=mesh, mp_policy=mp, quantize_all_gather=quantize)
        group = holder._get_fsdp_state().groups[0]
        holder.unshard()
        holder.reshard()
        times = []
        for _ in range(iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            holder.unshard()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            holder.reshard()
        entry = {"median_gather_ms": statistics.median(times),
                 "elements": sum(b.world_size * b.shard_size for b in group.buffers)}
        if group.quantizer is not None:
            entry["bytes"] = sum(g.wire_bytes for g in group.quantizer.gathers.values())
            gathers = list(group.quantizer.gathers.values())

            def requantize() -> None:
                for g in gathers:
                    g.invalidate()
                    g.local_segment()

            entry["quantize_ms"] = _cuda_ms(requantize, 5)
        else:
            entry["bytes"] = entry["elements"] * 2
        out[label] = entry
        del holder, block
        torch.cuda.empty_cache()
    out["bytes_ratio"] = out["fp8"]["bytes"] / out["bf16"]["bytes"]
    out["time_ratio"] = out["fp8"]["median_gather_ms"] / out["bf16"]["median_gather_ms"]
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--torch-2.11-shim", dest="shim", action="store_true",
                        help="run fsdp's all-gather on torch 2.11 (benchmarks/torch_211_shim.py)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    start = time.perf_counter()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                              "capability": list(torch.cuda.get_device_capability(0)),
                              "torch": torch.__version__, "cuda": torch.version.cuda,
                              "torch_211_shim": args.shim}
    for name, check in (("kernels", check_kernels), ("scaled_mm", check_scaled_mm),
                        ("all_gather", lambda: check_all_gather(args.shim))):
        try:
            report[name] = check()
        except Exception as error:  # noqa: BLE001 - one failing check must not hide the others
            report[name] = {"error": f"{type(error).__name__}: {error}"[:400]}
    report["wall_s"] = round(time.perf_counter() - start, 1)
    line = json.dumps(report)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
