"""fsdp vs FSDP2: whole training steps of a LLaMA-style model on 4 gloo ranks.

The same model (RMSNorm, causal attention, SwiGLU; 4 layers, d_model 256, vocab 1000, seq 128,
batch 4 per rank, 3.7M parameters; ``--moe``: each SwiGLU replaced by 4 experts, top-2, held as
fused 3-D tensors, each expert one unit for fsdp; ``--world-size`` for other rank counts) is wrapped torchtitan-style (each block, then the root) by
``torch.distributed.fsdp.fully_shard`` (FSDP2) and by ``fsdp.fully_shard`` and trained with
``torch.optim.AdamW``, in fp32 and with bf16 compute / fp32 gradient reduction
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``).

Each (system, mode) runs in freshly spawned ranks, one thread each, so that the peak memory of
one system never hides in the heap left by the other; the systems alternate (in swapped order
every round) so both see the same machine noise. Reported per mode:

* step time: median over every measured step of every round, each step the slowest rank's
  wall time (a barrier starts each step);
* peak RSS over baseline: per rank, ``VmHWM`` over the measured steps minus ``VmRSS`` right
  before the model is built (the high-water mark is reset through ``/proc/self/clear_refs``
  after the warm-up steps, so it is the training peak: model, optimizer state, unsharded
  parameters, gradients and activations; the one-time peak of construction and warm-up is
  reported apart). A forward/backward of an unsharded replica runs before the baseline, so
  kernels and modules torch loads lazily are not charged to either system; the largest rank
  is reported;
* bytes copied by the system's machinery: the copy ops (``dbuffer.profiling``: ``copy_``,
  ``_foreach_copy_``, ``split_with_sizes_copy``, ``chunk_cat``, ``cat`` into ``out=``, casts)
  that one profiled step issues on rank 0 outside the communication backend, minus those of
  the same forward/backward on an unsharded copy of the model (the model's own copies);
* ratios ours / FSDP2 (targets on a quiet machine: step time <= 0.90, peak memory <= 0.80).

glibc's dynamic mmap threshold keeps freed multi-MB blocks in the heap, so by default RSS
follows what the allocator happened to keep, not live tensors; ``--fixed-mmap-threshold``
pins ``MALLOC_MMAP_THRESHOLD_`` to 64 KiB in the ranks so large tensors go back to the OS
when freed and the peak follows live memory (at the cost of page faults on every large
allocation, paid most by the side that allocates more temporaries: take times from a run
without it). On the default model the peak is mostly activations (an unsharded one-process step of the
same model peaks ~210 MB over baseline in fp32, the whole fp32 model is 15 MB), which both
systems keep alike; ``--seq`` / ``--batch-per-rank`` shrink them to see the sharded state.

Run: ``python benchmarks/train_step.py [--steps N] [--warmup W] [--rounds R] [--moe]
[--world-size N]``; writes
``benchmarks/results/train_step.json``. On a shared machine timings are noisy: measure the
real figures on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The script's folder goes last on the import path, so `import fsdp` finds the package while
# the shared benchmark helpers stay importable.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gloo_ranks import run_on_gloo_ranks  # noqa: E402
from torch import nn  # noqa: E402

RESULTS = _HERE / "results" / "train_step.json"
SYSTEMS = {"fsdp2": "torch.distributed.fsdp", "fsdp": "fsdp"}
MODES = {"fp32": None, "bf16_compute_fp32_reduce": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """The benchmarked model and batch."""

    layers: int = 4
    dim: int = 256
    heads: int = 4
    ffn: int = 688
    vocab: int = 1000
    seq: int = 128
    batch_per_rank: int = 4
    experts: int = 0  # 0: dense SwiGLU blocks; else MoE blocks of this many experts
    top_k: int = 2



class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate, self.w_up = (nn.Linear(cfg.dim, cfg.ffn, bias=False) for _ in range(2))
        self.w_down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, their weights fused into 3-D tensors (expert, out, in) as
    in torchtitan's grouped experts; each expert's hidden size is ``ffn / top_k`` so a token
    costs about what it costs in the dense block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, self.top_k = cfg.ffn // cfg.top_k, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.w_gate, self.w_up = (nn.Parameter(torch.randn(cfg.experts, hidden, cfg.dim)
                                               * cfg.dim ** -0.5) for _ in range(2))
        self.w_down = nn.Parameter(torch.randn(cfg.experts, cfg.dim, hidden) * hidden ** -0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, h.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e in range(self.w_gate.shape[0]):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            x = tokens[rows]
            y = (F.silu(x @ self.w_gate[e].T) * (x @ self.w_up[e].T)) @ self.w_down[e].T
            out = out.index_add(0, rows, y * weights[rows, slot, None].to(y.dtype))
        return out.view_as(h)


def expert_unit(name: str, param: torch.Tensor) -> int:
    """fsdp's unit policy for the MoE model: one whole expert of a fused 3-D weight, else a row."""
    return param[0].numel() if param.dim() == 3 else param.numel() // param.shape[0]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False)
                                              for _ in range(4))
        self.mlp = MoE(cfg) if cfg.experts else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _status_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def _reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _loss(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, vocab),
                           tokens[:, 1:].reshape(-1))


def _scope_fsdp2_collectives(model: nn.Module) -> None:
    """Put FSDP2's collectives inside ``comm:`` profiler scopes, as DBuffer's are, so the copies
    gloo makes while completing them count as backend copies on both sides."""
    from fsdp2_scoped import ScopedAllGather, ScopedReduceScatter
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(ScopedAllGather())
            module.set_custom_reduce_scatter(ScopedReduceScatter())


def _issued_bytes(fn: Any) -> tuple[int, dict[str, int]]:
    """Bytes the copies issued by ``fn()`` write (outside gloo), and the bytes per op scope."""
    from dbuffer.profiling import profile_copies

    found = [c for c in profile_copies(fn) if not c.backend]
    by_scope: dict[str, int] = {}
    for c in found:
        scope = next((a for a in reversed(c.ancestors) if not a.startswith("aten::")), c.name)
        key = f"{scope} > {c.ancestors[-1] if c.ancestors else c.name}"
        by_scope[key] = by_scope.get(key, 0) + c.nbytes
    return sum(c.nbytes for c in found), by_scope


def measure_system(system: str, compute: torch.dtype | None, cfg: ModelConfig, steps: int,
                   warmup: int) -> dict[str, Any]:
    """On every rank: build, shard and train; rank 0 returns the step times, every rank's
    peak RSS over baseline and the profiled copies of one more step."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    api = importlib.import_module(SYSTEMS[system])
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = torch.randint(cfg.vocab, (warmup + steps + 1, cfg.batch_per_rank, cfg.seq + 1),
                            generator=gen)
    replica = Llama(cfg).to(compute or torch.float32)
    _loss(replica, batches[-1], cfg.vocab).backward()  # lazy loads happen here, for both
    dist.barrier()
    baseline = _status_kib("VmRSS")
    _reset_peak_rss()

    torch.manual_seed(0)
    model = Llama(cfg)
    policy = api.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    units = {"unit_policy": expert_unit} if system == "fsdp" and cfg.experts else {}
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, mp_policy=policy, **units)
    api.fully_shard(model, mesh=mesh, mp_policy=policy, **units)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor) -> None:
        _loss(model, tokens, cfg.vocab).backward()
        optimizer.step()
        optimizer.zero_grad()

    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step(batches[i])
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed) * 1e3)
        if i == warmup - 1:
            setup_peak = _status_kib("VmHWM") - baseline
            _reset_peak_rss()
    peaks = [None] * world_size
    dist.all_gather_object(peaks, (_status_kib("VmHWM") - baseline) * 1024)
    setup_peaks = [None] * world_size
    dist.all_gather_object(setup_peaks, setup_peak * 1024)

    if system == "fsdp2":
        _scope_fsdp2_collectives(model)
    copied, by_scope = _issued_bytes(lambda: step(batches[-1]))
    # the model's own copies: the same forward/backward on the unsharded replica
    own, _ = _issued_bytes(lambda: _loss(replica, batches[-1], cfg.vocab).backward())
    return {"step_ms": times, "peak_rss_over_baseline_bytes": peaks,
            "setup_peak_rss_over_baseline_bytes": setup_peaks,
            "copy_bytes_per_step": copied - own, "copy_bytes_total": copied,
            "copy_bytes_model_only": own,
            "copy_bytes_by_scope": dict(sorted(by_scope.items(), key=lambda kv: -kv[1])[:12])}


def run(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for mode, compute in MODES.items():
        rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
        for r in range(args.rounds):
            order = list(args.systems) if r % 2 == 0 else list(reversed(args.systems))
            for system in order:
                print(f"{mode}: round {r + 1}/{args.rounds}, {system}", flush=True)
                rounds[system].append(run_on_gloo_ranks(
                    measure_system, args.world_size, system, compute, cfg, args.steps, args.warmup))
        entry: dict[str, Any] = {}
        for system, results in rounds.items():
            times = [t for res in results for t in res["step_ms"]]
            entry[system] = {
                "median_step_ms": statistics.median(times),
                "min_step_ms": min(times),
                "peak_rss_over_baseline_bytes": max(max(res["peak_rss_over_baseline_bytes"])
                                                    for res in results),
                "peak_rss_over_baseline_bytes_per_rank": results[-1]["peak_rss_over_baseline_bytes"],
                "setup_peak_rss_over_baseline_bytes": max(
                    max(res["setup_peak_rss_over_baseline_bytes"]) for res in results),
                "copy_bytes_per_step": results[-1]["copy_bytes_per_step"],
                "copy_bytes_total": results[-1]["copy_bytes_total"],
                "copy_bytes_model_only": results[-1]["copy_bytes_model_only"],
                "copy_bytes_by_scope": results[-1]["copy_bytes_by_scope"],
            }
        if set(entry) == set(SYSTEMS):
            ours, theirs = entry["fsdp"], entry["fsdp2"]
            entry["ratios_ours_over_fsdp2"] = {
                "step_time": ours["median_step_ms"] / theirs["median_step_ms"],
                "peak_memory": ours["peak_rss_over_baseline_bytes"]
                / theirs["peak_rss_over_baseline_bytes"],
                "copy_bytes": ours["copy_bytes_per_step"] / max(theirs["copy_bytes_per_step"], 1),
            }
        report[mode] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2,
                        help="fresh-process runs per system and mode, alternating")
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--note", default="shared 2-core machine: timings are noisy; measure "
                        "the real figures on a quiet machine")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fixed-mmap-threshold", action="store_true",
                        help="MALLOC_MMAP_THRESHOLD_=65536 in the ranks: RSS follows live memory")
    for name, value in asdict(ModelConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                            help="model/batch size (a smaller --seq or --batch-per-rank makes "
                            "parameters, not activations, dominate the peak)")
    parser.add_argument("--moe", dest="experts", action="store_const", const=4,
                        help="MoE blocks: 4 experts, top-2 (the same as --experts 4)")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the training peak is measured after it)")

    cfg = ModelConfig(**{name: getattr(args, name) for name in asdict(ModelConfig())})
    if args.fixed_mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    report = run(args, cfg)
    result = {
        "benchmark": "training step, fsdp vs FSDP2 (torch.distributed.fsdp.fully_shard)",
        "world_size": args.world_size, "backend": "gloo (CPU, 1 thread per rank)",
        "model": asdict(cfg), "optimizer": "torch.optim.AdamW",
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "targets": {"step_time": 0.90, "peak_memory": 0.80},
        "note": args.note,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default (dynamic)"),
        "modes": report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'mode':26s} {'system':6s} {'step ms':>8s} {'peak MB':>8s} {'setup MB':>8s} "
          f"{'copy MB':>8s}")
    for mode, entry in report.items():
        for system in args.systems:
            e = entry[system]
            print(f"{mode:26s} {system:6s} {e['median_step_ms']:8.1f} "
                  f"{e['peak_rss_over_baseline_bytes'] / 2**20:8.1f} "
                  f"{e['setup_peak_rss_over_baseline_bytes'] / 2**20:8.1f} "
                  f"{e['copy_bytes_per_step'] / 2**20:8.2f}")
        if "ratios_ours_over_fsdp2" in entry:
            r = entry["ratios_ours_over_fsdp2"]
            print(f"{mode:26s} ours/FSDP2: step time {r['step_time']:.2f}x (target <= 0.90), "
                  f"peak memory {r['peak_memory']:.2f}x (target <= 0.80), "
                  f"copy bytes {r['copy_bytes']:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
