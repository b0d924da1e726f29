"""fsdp vs FSDP2: CPU time spent in the systems' hooks per training step, many small parameters.

The model is 8 blocks of 24 small ``nn.Linear`` layers each (64 x 64 with bias: 48 parameters
per block, 386 in all), batch 2, so a step's own compute is tiny and the hooks' Python work
shows. Each block and the root are wrapped (defaults), ``torch.optim.AdamW``, 2 gloo ranks.

Every entry point through which autograd or ``nn.Module`` calls into a system is wrapped in
a timer (no profiler scope: a scope's own cost would weigh on the side with more hook calls):
fsdp's forward pre/post hooks, pre-backward
hook, ``_PostBackward.backward``, per-parameter post-accumulate-grad hook, the pre-accumulate
hook of each buffer's first gradient and final callback;
FSDP2's forward pre/post hooks, pre-backward hook, ``FSDPParamGroup.post_backward`` and final
callback. A hook's cost is the training thread's CPU time (``time.thread_time_ns``) from entry
to exit, outermost hook only: waiting on gloo (which runs collectives on its own threads)
blocks without CPU time, so the figure is host overhead (Python, dispatch, copies issued by
the hook), not communication. Reported: the median over measured steps of the slowest rank's
hook CPU time per step, per hook and in total, and fsdp / FSDP2 (target <= 0.5).

This machine's CPU time per step moves by a third between runs of the same code (other
tenants, frequency), so the systems run side by side in rounds, alternating which goes
first; the ratio is the median over rounds of each round's ratio, and the per-hook figures
are those of the median round.

Run: ``python benchmarks/hook_overhead.py [--blocks 8] [--linears 24] [--dim 64]
[--steps 10] [--rounds 3] [--world-size 2]``; writes ``benchmarks/results/hook_overhead.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gloo_ranks import run_on_gloo_ranks  # noqa: E402
from torch import nn  # noqa: E402

RESULTS = _HERE / "results" / "hook_overhead.json"
SYSTEMS = {"fsdp": "fsdp", "fsdp2": "torch.distributed.fsdp"}


@dataclass(frozen=True)
class Config:
    """The model and batch."""

    blocks: int = 8
    linears: int = 24
    dim: int = 64
    batch: int = 2


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(cfg.dim, cfg.dim) for _ in range(cfg.linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = torch.tanh(linear(x))
        return x


class ManySmall(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.head = nn.Linear(cfg.dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


class HookClock:
    """CPU time of the training thread inside hooks, outermost call only, per hook name."""

    def __init__(self) -> None:
        self.ns: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._depth = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[name] += time.thread_time_ns() - start
                self.calls[name] += 1
                self._depth -= 1

        return timed

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()


def _hook_sites(system: str) -> list[tuple[Any, str, bool]]:
    """(class, attribute, is_staticmethod) of every entry point into ``system``."""
    if system == "fsdp":
        from fsdp.managed_param import ManagedParam
        from fsdp.state import FSDPState, StepContext, _PostBackward

        return [(FSDPState, "_module_pre_forward", False), (FSDPState, "_module_post_forward", False),
                (FSDPState, "_pre_backward", False), (StepContext, "end_backward", False),
                (_PostBackward, "backward", True), (ManagedParam, "_before_accumulate", False),
                (ManagedParam, "_note_grad", False)]
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return [(FSDPState, "_pre_forward", False), (FSDPState, "_post_forward", False),
            (FSDPState, "_pre_backward", False),
            (FSDPState, "_root_post_backward_final_callback", False),
            (FSDPParamGroup, "post_backward", False)]


def install(system: str, clock: HookClock) -> None:
    """Wrap ``system``'s hook entry points (before ``fully_shard``, which binds them)."""
    for cls, attr, static in _hook_sites(system):
        fn = cls.__dict__[attr]
        fn = fn.__func__ if static else fn
        wrapped = clock.wrap(f"{cls.__name__}.{attr}", fn)
        setattr(cls, attr, staticmethod(wrapped) if static else wrapped)


def measure(system: str, cfg: Config, steps: int, warmup: int) -> dict[str, Any]:
    """On every rank: per measured step, the hook CPU time (all hooks and per hook) and the
    step's thread CPU time; rank 0 returns every rank's lists."""
    from torch.distributed.device_mesh import init_device_mesh

    api = importlib.import_module(SYSTEMS[system])
    clock = HookClock()
    install(system, clock)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = ManySmall(cfg)
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(cfg.batch, cfg.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    totals, per_hook, step_cpu = [], [], []
    for i in range(warmup + steps):
        clock.reset()
        start = time.thread_time_ns()
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            step_cpu.append(time.thread_time_ns() - start)
            totals.append(sum(clock.ns.values()))
            per_hook.append(dict(clock.ns))
    calls = dict(clock.calls)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"hook_ns": totals, "per_hook_ns": per_hook,
                                   "step_cpu_ns": step_cpu, "calls_per_step": calls})
    return ranks


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over steps of the slowest rank's figures."""
    steps = len(ranks[0]["hook_ns"])
    hook = [max(r["hook_ns"][s] for r in ranks) for s in range(steps)]
    step = [max(r["step_cpu_ns"][s] for r in ranks) for s in range(steps)]
    names = sorted({n for r in ranks for d in r["per_hook_ns"] for n in d})
    per_hook = {n: statistics.median(max(r["per_hook_ns"][s].get(n, 0) for r in ranks)
                                     for s in range(steps)) / 1e6 for n in names}
    return {"hook_cpu_ms_per_step": statistics.median(hook) / 1e6,
            "step_cpu_ms": statistics.median(step) / 1e6,
            "per_hook_cpu_ms": per_hook, "calls_per_step": ranks[0]["calls_per_step"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(Config()).items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cfg = Config(**{k: getattr(args, k) for k in asdict(Config())})
    result: dict[str, Any] = {"benchmark": "CPU time in hooks per step, fsdp vs FSDP2",
                              "model": asdict(cfg), "world_size": args.world_size,
                              "steps": args.steps, "warmup": args.warmup}
    rounds = []
    for index in range(args.rounds):
        order = list(SYSTEMS) if index % 2 == 0 else list(reversed(SYSTEMS))
        one = {system: summarize(run_on_gloo_ranks(measure, args.world_size, system, cfg,
                                                   args.steps, args.warmup))
               for system in order}
        one["ratio"] = one["fsdp"]["hook_cpu_ms_per_step"] / one["fsdp2"]["hook_cpu_ms_per_step"]
        print(f"round {index}: fsdp {one['fsdp']['hook_cpu_ms_per_step']:.2f} ms, FSDP2 "
              f"{one['fsdp2']['hook_cpu_ms_per_step']:.2f} ms, ratio {one['ratio']:.2f}",
              flush=True)
        rounds.append(one)
    median = sorted(rounds, key=lambda one: one["ratio"])[(len(rounds) - 1) // 2]
    for system in SYSTEMS:
        result[system] = median[system]
        print(f"{system:6s} hooks {result[system]['hook_cpu_ms_per_step']:8.2f} ms CPU/step "
              f"(step {result[system]['step_cpu_ms']:8.2f} ms CPU)", flush=True)
        for name, ms in sorted(result[system]["per_hook_cpu_ms"].items(), key=lambda kv: -kv[1]):
            print(f"         {name:45s} {ms:8.2f} ms  x{result[system]['calls_per_step'].get(name, 0)}")
    result["rounds"] = [one["ratio"] for one in rounds]
    result["ratio_fsdp_over_fsdp2"] = median["ratio"]
    print(f"fsdp / FSDP2 hook CPU time, median of {len(rounds)} rounds: "
          f"{result['ratio_fsdp_over_fsdp2']:.2f} (target <= 0.5)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
