"""AdamW8bit vs torch.optim.AdamW on a LLaMA-like parameter set: optimizer-state bytes per
parameter and step time.

State bytes count every tensor the optimizer keeps per parameter (codes, scales, fp32 moments
of small tensors, step counters), divided by the number of parameters: the goal is <= 2.05 B
(1 B per moment for the codes plus 4 B per 256-element block for each scale) against AdamW's
8 B (two fp32 moments). Step time: the CPU (torch) path of AdamW8bit against AdamW's default
(foreach) path, one thread, two warm-up steps, then ``--steps`` steps of each optimizer taken
alternately (so both see the same background load on a shared machine); the medians of the
wall-clock time and of the process CPU time (less sensitive to other processes) are reported,
with their ratios. Goal: step time ratio <= 3.

Usage: ``python benchmarks/optim_adamw8bit.py [--layers 2] [--dim 512] [--steps 7]
[--output PATH]``. Writes ``benchmarks/results/optim_adamw8bit.json`` unless told otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

# Keep this script's folder off the import path (it holds scripts named like packages).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from block_optim import AdamW8bit  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "optim_adamw8bit.json"


def llama_shapes(layers: int, dim: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Embedding, per layer GQA attention + SwiGLU MLP + two RMSNorm weights, final norm, head."""
    hidden, kv_dim = int(8 * dim / 3) // 64 * 64, dim // 4
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, dim)}
    for i in range(layers):
        shapes |= {
            f"l{i}.attn_norm": (dim,), f"l{i}.wq": (dim, dim), f"l{i}.wk": (kv_dim, dim),
            f"l{i}.wv": (kv_dim, dim), f"l{i}.wo": (dim, dim), f"l{i}.mlp_norm": (dim,),
            f"l{i}.w_gate": (hidden, dim), f"l{i}.w_up": (hidden, dim),
            f"l{i}.w_down": (dim, hidden),
        }
    return shapes | {"norm": (dim,), "head": (vocab, dim)}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def _setup(make_opt, shapes: dict[str, tuple[int, ...]]) -> tuple[torch.optim.Optimizer, int]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes.values()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return make_opt(params), sum(p.numel() for p in params)


def measure(makers: dict[str, object], shapes: dict[str, tuple[int, ...]],
            steps: int) -> dict[str, dict[str, float]]:
    """Step each optimizer in turn, ``steps + 2`` times; medians after two warm-up steps."""
    opts = {name: _setup(make, shapes) for name, make in makers.items()}
    wall: dict[str, list[float]] = {name: [] for name in opts}
    cpu: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(steps + 2):
        for name, (opt, _) in opts.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            opt.step()
            if i >= 2:
                wall[name].append(time.perf_counter() - start_wall)
                cpu[name].append(time.process_time() - start_cpu)
    return {
        name: {"state_bytes": state_bytes(opt), "state_bytes_per_param": state_bytes(opt) / numel,
               "step_ms_median": 1e3 * statistics.median(wall[name]),
               "step_cpu_ms_median": 1e3 * statistics.median(cpu[name]),
               "step_ms_all": [round(1e3 * t, 2) for t in wall[name]]}
        for name, (opt, numel) in opts.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = llama_shapes(args.layers, args.dim, args.vocab)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    runs = measure({"adamw8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
                    "torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}, shapes, args.steps)
    ours, ref = runs["adamw8bit"], runs["torch_adamw"]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"params": numel, "tensors": len(shapes), "threads": 1},
        "adamw8bit": ours,
        "torch_adamw": ref,
        "state_bytes_ratio": ours["state_bytes"] / ref["state_bytes"],
        "step_time_ratio": ours["step_ms_median"] / ref["step_ms_median"],
        "step_cpu_time_ratio": ours["step_cpu_ms_median"] / ref["step_cpu_ms_median"],
        "goal_state_bytes_per_param": 2.05,
        "goal_met": ours["state_bytes_per_param"] <= 2.05,
        "goal_step_time_ratio": 3.0,
    }
    print(f"{numel / 1e6:.2f}M params in {len(shapes)} tensors")
    print(f"{'':14}{'state B/param':>14}{'step ms':>10}{'cpu ms':>10}")
    for name, r in (("AdamW8bit", ours), ("torch AdamW", ref)):
        print(f"{name:14}{r['state_bytes_per_param']:14.4f}{r['step_ms_median']:10.1f}"
              f"{r['step_cpu_ms_median']:10.1f}")
    print(f"ratios (8bit / AdamW): state {result['state_bytes_ratio']:.3f}, step time "
          f"{result['step_time_ratio']:.2f} wall, {result['step_cpu_time_ratio']:.2f} cpu "
          "(CPU, one thread, noisy)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
