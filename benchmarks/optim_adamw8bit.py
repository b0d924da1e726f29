"""AdamW8bit vs torch.optim.AdamW on a LLaMA-like parameter set: optimizer-state bytes per
parameter and step time.

State bytes count every tensor the optimizer keeps per parameter (codes, scales, fp32 moments
of small tensors, step counters), divided by the number of parameters: the goal is <= 2.05 B
(1 B per moment for the codes plus 4 B per 256-element block for each scale) against AdamW's
8 B (two fp32 moments). Step time is the median over ``--steps`` steps after two warm-up steps,
one thread, the CPU (torch) path of AdamW8bit against AdamW's default (foreach) path. CPU
timings on a shared machine are noisy: compare the ratio from one run.

Usage: ``python benchmarks/optim_adamw8bit.py [--layers 2] [--dim 512] [--steps 5]``. Writes
``benchmarks/results/optim_adamw8bit.json``.
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


def measure(make_opt, shapes: dict[str, tuple[int, ...]], steps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes.values()]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes.values()]
    opt = make_opt(params)
    times = []
    for i in range(steps + 2):
        for p, g in zip(params, grads):
            p.grad = g
        start = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    numel = sum(p.numel() for p in params)
    return {"state_bytes": state_bytes(opt), "state_bytes_per_param": state_bytes(opt) / numel,
            "step_ms_median": 1e3 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = llama_shapes(args.layers, args.dim, args.vocab)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    ours = measure(lambda ps: AdamW8bit(ps, lr=1e-3), shapes, args.steps)
    ref = measure(lambda ps: torch.optim.AdamW(ps, lr=1e-3), shapes, args.steps)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": vars(args) | {"params": numel, "tensors": len(shapes), "threads": 1},
        "adamw8bit": ours,
        "torch_adamw": ref,
        "state_bytes_ratio": ours["state_bytes"] / ref["state_bytes"],
        "step_time_ratio": ours["step_ms_median"] / ref["step_ms_median"],
        "goal_state_bytes_per_param": 2.05,
        "goal_met": ours["state_bytes_per_param"] <= 2.05,
    }
    print(f"{numel / 1e6:.2f}M params in {len(shapes)} tensors")
    print(f"{'':14}{'state B/param':>14}{'step ms':>10}")
    for name, r in (("AdamW8bit", ours), ("torch AdamW", ref)):
        print(f"{name:14}{r['state_bytes_per_param']:14.4f}{r['step_ms_median']:10.1f}")
    print(f"ratios (8bit / AdamW): state {result['state_bytes_ratio']:.3f}, "
          f"step time {result['step_time_ratio']:.2f}  (CPU, noisy)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
