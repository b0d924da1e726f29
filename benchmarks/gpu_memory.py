"""fsdp vs FSDP2 on one CUDA GPU: peak allocated and reserved bytes and step time.

The CUDA counterpart of ``benchmarks/memory.py``: ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` (the caching allocator's fragmentation shows in the second) over the
measured steps of ``train_step.py``'s LLaMA-style model, each block and the root wrapped,
``torch.optim.AdamW``, fp32 or bf16 compute with fp32 reduction; each (system, mode) in a fresh
process so that one system's cached blocks never serve the other. With one GPU the world size
is 1 (NCCL): FSDP2 still copies into and out of its all-gather and reduce-scatter buffers,
fsdp's parameters and gradients are views of its buffers; both issue no collective.

Every row also records the losses of its steps: both systems train the same model on the same
tokens, so the two losses of a step agree to rounding, and the summary line gives the largest
relative difference per mode (a run whose fsdp trained wrongly shows there, not only in time).

Each row also splits the median step into forward, backward and optimizer step, timed with CUDA
events on the GPU's own timeline. ``--profile DIR`` adds two steps under ``torch.profiler``
after the measured ones and writes each (system, mode)'s operators by GPU and by CPU self time
to ``DIR/<system>_<mode>.txt``: where a ratio is off, that file says which kernels or host calls
make the difference.

``--torch-2.11-shim``: run fsdp on torch 2.11 (the lent GPU image's) with
:mod:`torch_211_shim`; the rows and the JSON record whether it was used.

Run on a CUDA machine: ``python benchmarks/gpu_memory.py [--layers 8 --dim 2048 ...]``;
prints one JSON line per (system, mode) and a summary line with the ratios, and writes
``benchmarks/results/gpu_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
import torch_211_shim  # noqa: E402
from train_step import Llama, ModelConfig, _loss  # noqa: E402

RESULTS = _HERE / "results" / "gpu_memory.json"
SYSTEMS = {"fsdp": "fsdp", "fsdp2": "torch.distributed.fsdp"}


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
          vocab: int) -> tuple[torch.Tensor, list[torch.cuda.Event]]:
    """One training step; returns the loss and CUDA events before forward, backward,
    optimizer step and after it."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    events[0].record()
    loss = _loss(model, tokens, vocab)
    events[1].record()
    loss.backward()
    events[2].record()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    events[3].record()
    return loss, events


def _write_profile(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   tokens: torch.Tensor, vocab: int) -> None:
    """Two more steps under torch.profiler: operators by GPU self time, then by CPU self time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            _step(model, optimizer, tokens, vocab)
        torch.cuda.synchronize()
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(
        table.table(sort_by=key, row_limit=30, max_name_column_width=60)
        for key in ("self_device_time_total", "self_cpu_time_total")) + "\n")


def measure(system: str, mode: str, cfg: ModelConfig, steps: int, warmup: int,
            shim: bool = False, profile_dir: Path | None = None) -> dict:
    """One (system, mode) in this process: peaks over the measured steps, the median
    step time and its phases, and every step's loss."""
    import importlib

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    if shim and system == "fsdp":
        torch_211_shim.install()
    api = importlib.import_module(SYSTEMS[system])
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    model = Llama(cfg).cuda()
    kwargs: dict = {"mesh": mesh}
    if mode == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    for layer in model.layers:
        api.fully_shard(layer, **kwargs)
    api.fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab, (cfg.batch_per_rank, cfg.seq + 1), generator=g).cuda()
    times, phases, losses = [], [], []
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss, events = _step(model, optimizer, tokens, cfg.vocab)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
            phases.append([a.elapsed_time(b) for a, b in zip(events, events[1:])])
        losses.append(loss.item())
    out = {"system": system, "mode": mode, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "torch_211_shim": shim and system == "fsdp",
           "losses": losses,
           "max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
           "max_reserved_mb": torch.cuda.max_memory_reserved() / 2**20,
           "between_steps_mb": torch.cuda.memory_allocated() / 2**20,
           "step_ms": 1000 * sorted(times)[len(times) // 2], "config": asdict(cfg)}
    for i, name in enumerate(("forward_ms", "backward_ms", "optimizer_ms")):
        out[name] = sorted(p[i] for p in phases)[len(phases) // 2]
    if profile_dir is not None:
        _write_profile(profile_dir / f"{system}_{mode}.txt", model, optimizer, tokens, cfg.vocab)
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--torch-2.11-shim", dest="shim", action="store_true",
                        help="let ragged_dtensor install on torch 2.11 (see the docstring)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="write each run's operators by GPU and CPU self time under DIR")
    parser.add_argument("--one", nargs=2, metavar=("SYSTEM", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cfg = ModelConfig(layers=args.layers, dim=args.dim, heads=args.heads, ffn=args.ffn,
                      vocab=args.vocab, seq=args.seq, batch_per_rank=args.batch)
    if args.one:
        print(json.dumps(measure(*args.one, cfg, args.steps, args.warmup, args.shim,
                                 args.profile)), flush=True)
        return
    rows = []
    for mode in args.modes:
        for system in SYSTEMS:
            cmd = [sys.executable, __file__, "--one", system, mode, "--layers", str(args.layers),
                   "--dim", str(args.dim), "--heads", str(args.heads), "--ffn", str(args.ffn),
                   "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--torch-2.11-shim"] if args.shim else []
            cmd += ["--profile", str(args.profile)] if args.profile else []
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            line = [x for x in done.stdout.splitlines() if x.startswith("{")]
            if not line:
                print(f"{system} {mode} failed: {done.stderr[-2000:]}", flush=True)
                continue
            rows.append(json.loads(line[-1]))
            print(line[-1], flush=True)
    ratios = {}
    for mode in args.modes:
        by = {r["system"]: r for r in rows if r["mode"] == mode}
        if len(by) == 2:
            ratios[mode] = {k: by["fsdp"][k] / by["fsdp2"][k]
                            for k in ("max_allocated_mb", "max_reserved_mb", "step_ms",
                                      "forward_ms", "backward_ms", "optimizer_ms")}
            ratios[mode]["loss_max_rel_diff"] = max(
                abs(a - b) / abs(b) for a, b in zip(by["fsdp"]["losses"], by["fsdp2"]["losses"]))
    print(json.dumps({"ratios_fsdp_over_fsdp2": ratios}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
