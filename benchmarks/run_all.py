"""Run every benchmark, gather their JSON into ``benchmarks/results/all.json``, render the page.

Each benchmark script runs as a subprocess with settings small enough that the whole run
finishes in under 20 minutes on 2 CPU cores (``--quick``: a smoke run of a few minutes). The
scripts' own JSON goes into ``all.json`` under ``benchmarks`` and every headline ratio into
``ratios`` (ours / the reference, lower is better unless named otherwise):

* ``train_step``: fsdp / FSDP2 step time, peak memory and copied bytes, fp32 and bf16, 2 and 4
  ranks, dense and MoE models (``benchmarks/train_step.py``);
* ``memory``: fsdp / FSDP2 allocator bytes per phase of a step (forward, backward, optimizer
  step, between steps) and at the peak, per model, precision and world size
  (``benchmarks/memory.py``); ``hook_overhead``: fsdp / FSDP2 CPU time in hooks per step on a
  model of many small parameters (``benchmarks/hook_overhead.py``);
* ``copy_bytes_per_step``: the bytes each system's machinery copies per training step and per
  all-gather + reduce-scatter of one layer (``benchmarks/dbuffer.py``);
* ``dbuffer_time``, ``muon_step_time``, ``adamw8bit``, ``ragged_redistribute``,
  ``ragged_handlers``: the component benchmarks;
* ``padding``: whole-model padding (fraction of the parameters) of this planner
  (``plan_buckets``, what ``fsdp.fully_shard`` uses), FSDP2's per-tensor dim-0 padding and a
  row-aligned scheme in the style of Megatron-FSDP (every tensor on its row lattice, shards a
  multiple of the LCM of the row sizes), catalog models, world sizes 8 to 16384, in process.

Scripts that write a fixed result file get it back as it was, so the committed per-script
figures (taken with their full default settings) stay as they are.

    python benchmarks/run_all.py [--quick] [--only NAME ...] [--no-render] [--out PATH]

``--quick`` writes its JSON to the temporary folder and renders no page, so a smoke run never
replaces the committed figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layout_planner.catalog import catalog
from layout_planner.report import report_model
from layout_planner.units import parse_unit

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "all.json"
PADDING_WORLDS = [2**k for k in range(3, 15)]  # 8 .. 16384
TRAIN_WORLDS = (2, 4)
MODES = {"fp32": "fp32", "bf16": "bf16_compute_fp32_reduce"}
MEMORY_PHASES = ("forward", "backward", "optimizer", "between")


@dataclass(frozen=True)
class Job:
    """One benchmark script run: its arguments for the full and the quick run, and where its
    JSON goes (``out_flag`` names the script's output option; ``None``: it writes
    ``fixed_out``, which is restored afterwards)."""

    key: str
    script: str
    args: tuple[str, ...]
    quick_args: tuple[str, ...]
    out_flag: str | None = "--out"
    fixed_out: str | None = None
    full_only: bool = False


def _train_jobs() -> list[Job]:
    jobs = []
    for model in ("dense", "moe"):
        for world in TRAIN_WORLDS:
            extra = ("--world-size", str(world)) + (("--moe",) if model == "moe" else ())
            jobs.append(Job(f"train_step_{model}_ws{world}", "train_step.py",
                            ("--layers", "2", "--seq", "64", "--batch-per-rank", "2",
                             "--steps", "4", "--warmup", "1", "--rounds", "2") + extra,
                            ("--layers", "1", "--seq", "16", "--batch-per-rank", "1",
                             "--steps", "1", "--warmup", "1", "--rounds", "1") + extra))
    return jobs


BENCHMARKS: dict[str, list[Job]] = {
    "planner": [Job("planner", "planner.py", (), (), out_flag=None,
                    fixed_out="planner.json", full_only=True)],
    "ragged": [
        Job("ragged_redistribute", "ragged_redistribute.py",
            ("--rows", "512", "--cols", "512", "--iters", "10"),
            ("--rows", "64", "--cols", "64", "--iters", "2"),
            out_flag=None, fixed_out="ragged_redistribute.json"),
        Job("ragged_handlers", "ragged_handlers.py", ("--rounds", "5", "--iters", "100"),
            ("--pairs", "1", "--rounds", "1", "--iters", "10")),
    ],
    "dbuffer": [Job("dbuffer", "dbuffer.py", ("--iters", "10", "--warmup", "2"),
                    ("--dim", "128", "--hidden", "384", "--iters", "2", "--warmup", "1"))],
    "optimizer": [
        Job("optim_muon", "optim.py", ("--layers", "2", "--dim", "256", "--steps", "2"),
            ("--layers", "1", "--dim", "64", "--steps", "1"),
            out_flag=None, fixed_out="optim_muon.json"),
        Job("optim_adamw8bit", "optim_adamw8bit.py", ("--steps", "5"),
            ("--layers", "1", "--dim", "128", "--vocab", "500", "--steps", "2"),
            out_flag="--output"),
    ],
    "train_step": _train_jobs(),
    "memory": [
        Job("memory", "memory.py", ("--worlds", "2", "4"),
            ("--models", "small", "--dtypes", "fp32", "--worlds", "2", "--steps", "1")),
        Job("hook_overhead", "hook_overhead.py", ("--steps", "10"),
            ("--blocks", "2", "--linears", "4", "--steps", "2", "--warmup", "1", "--rounds", "1")),
    ],
    "fp8": [Job("fp8_all_gather", "fp8_all_gather.py", ("--iters", "3", "--steps", "2"),
                ("--world-sizes", "2", "--dim", "256", "--ffn", "704", "--iters", "1",
                 "--steps", "1", "--model-dim", "128", "--layers", "1"))],
}


def run_job(job: Job, quick: bool, scratch: Path) -> tuple[dict[str, Any], float]:
    """Run one script; its JSON and its wall time in seconds."""
    cmd = [sys.executable, str(HERE / job.script), *(job.quick_args if quick else job.args)]
    if job.out_flag is not None:
        out = scratch / f"{job.key}.json"
        cmd += [job.out_flag, str(out)]
    else:
        out = HERE / "results" / job.fixed_out
        saved = out.read_bytes() if out.exists() else None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"[run_all] {job.key}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, env=env, cwd=HERE.parent)
        result = json.loads(out.read_text())
    finally:
        if job.out_flag is None and saved is not None:
            out.write_bytes(saved)
    return result, time.perf_counter() - start


def padding_sweep(worlds: list[int]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Whole-model padding (fraction of the model's parameters) per catalog model and world size:
    ``ours`` (plan_buckets), ``single_plan``, ``fsdp2``, ``row_aligned`` (``None`` where it
    would cut an indivisible tensor) and ``bound`` (no layout can pad less); units are rows."""
    rows = parse_unit("rows:1")
    fields = {"ours": "buckets", "single_plan": "plan", "fsdp2": "fsdp2",
              "row_aligned": "naive_lcm", "bound": "bound_any"}
    sweep: dict[str, dict[str, dict[str, float | None]]] = {}
    for model in catalog().values():
        sweep[model.name] = {}
        for world in worlds:
            groups = report_model(model, world, rows)
            total = sum(g.numel * g.count for g in groups)
            entry: dict[str, float | None] = {}
            for name, attr in fields.items():
                values = [getattr(g, attr) for g in groups]
                entry[name] = (None if None in values
                               else sum(v * g.count for v, g in zip(values, groups)) / total)
            sweep[model.name][str(world)] = entry
    return sweep


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _train_ratios(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    ratios: dict[str, Any] = {}
    copies: dict[str, Any] = {}
    for model in ("dense", "moe"):
        for world in TRAIN_WORLDS:
            res = results.get(f"train_step_{model}_ws{world}")
            if res is None:
                continue
            for short, mode in MODES.items():
                entry = res["modes"][mode]
                r = entry["ratios_ours_over_fsdp2"]
                ratios.setdefault(model, {}).setdefault(short, {})[str(world)] = {
                    "step_time": r["step_time"], "peak_memory": r["peak_memory"],
                    "copy_bytes": r["copy_bytes"],
                    "fsdp_step_ms": entry["fsdp"]["median_step_ms"],
                    "fsdp2_step_ms": entry["fsdp2"]["median_step_ms"],
                    "fsdp_peak_bytes": entry["fsdp"]["peak_rss_over_baseline_bytes"],
                    "fsdp2_peak_bytes": entry["fsdp2"]["peak_rss_over_baseline_bytes"]}
                copies.setdefault(model, {}).setdefault(short, {})[str(world)] = {
                    "fsdp": entry["fsdp"]["copy_bytes_per_step"],
                    "fsdp2": entry["fsdp2"]["copy_bytes_per_step"],
                    "ratio": _ratio(entry["fsdp"]["copy_bytes_per_step"],
                                    entry["fsdp2"]["copy_bytes_per_step"])}
    return ratios, copies


def _issued_bytes(side: dict[str, Any]) -> int:
    """Bytes one side of the dbuffer benchmark copies itself (outside gloo), AG + RS."""
    return sum(c["issued"]["bytes"] for c in side["copies"].values() if isinstance(c, dict))


def ratios(results: dict[str, Any], padding: dict[str, Any] | None) -> dict[str, Any]:
    """Every headline ratio the results hold (missing benchmarks leave their keys out)."""
    out: dict[str, Any] = {}
    train, copies = _train_ratios(results)
    if train:
        out["train_step"] = train
        out["copy_bytes_per_step"] = {"train_step": copies}
    if "dbuffer" in results:
        modes = results["dbuffer"]["modes"]
        out["dbuffer_time"] = {short: _ratio(modes[m]["dbuffer"]["total_ms"], modes[m]["fsdp2"]["total_ms"])
                               for short, m in MODES.items()}
        out.setdefault("copy_bytes_per_step", {})["dbuffer_layer"] = {
            short: {"dbuffer": _issued_bytes(modes[m]["dbuffer"]),
                    "fsdp2": _issued_bytes(modes[m]["fsdp2"]),
                    "ratio": _ratio(_issued_bytes(modes[m]["dbuffer"]),
                                    _issued_bytes(modes[m]["fsdp2"]))}
            for short, m in MODES.items()}
    if "optim_muon" in results:
        med = results["optim_muon"]["median_step_s"]
        out["muon_step_time"] = {"ours_over_fsdp2_torch_muon": med["ours"] / med["fsdp2_torch_muon"],
                                 "ours_over_replicated": med["ours"] / med["replicated"],
                                 "median_step_s": med}
    if "optim_adamw8bit" in results:
        r = results["optim_adamw8bit"]
        out["adamw8bit"] = {"state_bytes": r["state_bytes_ratio"], "step_time": r["step_time_ratio"]}
    if "ragged_redistribute" in results:
        out["ragged_redistribute"] = {f"{row['ragged']} vs {row['torch']}": row["ratio"]
                                      for row in results["ragged_redistribute"]["rows"]}
    if "ragged_handlers" in results:
        rows = results["ragged_handlers"]["rows"]
        out["ragged_handlers"] = {"median_with_over_without": statistics.median(r["ratio"] for r in rows),
                                  "per_op": {f"{r['op']} {r['placement']}": r["ratio"] for r in rows},
                                  "wrapper_bound": max(
                                      (w["bound_ratio"] for w in
                                       results["ragged_handlers"].get("wrapper_work", [])),
                                      default=None)}
    if "memory" in results:
        out["memory"] = {key: {"ratios": entry["ratios_fsdp_over_fsdp2"],
                               "fsdp_bytes": {p: entry["fsdp"][p]["bytes"] for p in MEMORY_PHASES},
                               "fsdp2_bytes": {p: entry["fsdp2"][p]["bytes"] for p in MEMORY_PHASES},
                               **({"difference_bytes": entry["difference_fsdp_minus_fsdp2_bytes"]}
                                  if "difference_fsdp_minus_fsdp2_bytes" in entry else {})}
                         for key, entry in results["memory"]["configs"].items()
                         if "ratios_fsdp_over_fsdp2" in entry}
    if "hook_overhead" in results:
        h = results["hook_overhead"]
        out["hook_overhead"] = {"ratio": h["ratio_fsdp_over_fsdp2"],
                                "fsdp_ms": h["fsdp"]["hook_cpu_ms_per_step"],
                                "fsdp2_ms": h["fsdp2"]["hook_cpu_ms_per_step"]}
    if padding is not None:
        out["padding"] = padding
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny sizes, few steps; JSON to the temp folder, no page")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS) + ["padding"],
                        help="run only these benchmarks (default: all, padding sweep included)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"default {RESULTS.relative_to(HERE.parent)} (--quick: the temp folder)")
    parser.add_argument("--no-render", action="store_true", help="skip docs/benchmarks.md and plots")
    args = parser.parse_args(argv)
    names = args.only or [*BENCHMARKS, "padding"]
    out = args.out or (Path(tempfile.gettempdir()) / "all_quick.json" if args.quick else RESULTS)

    start = time.perf_counter()
    results: dict[str, Any] = {}
    walls: dict[str, float] = {}
    failed: dict[str, str] = {}
    padding = None
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            if name == "padding":
                t0 = time.perf_counter()
                padding = padding_sweep(PADDING_WORLDS[::4] if args.quick else PADDING_WORLDS)
                walls["padding"] = time.perf_counter() - t0
                continue
            for job in BENCHMARKS[name]:
                if args.quick and job.full_only:
                    continue
                try:
                    results[job.key], walls[job.key] = run_job(job, args.quick, Path(scratch))
                except (subprocess.CalledProcessError, OSError, ValueError) as error:
                    failed[job.key] = str(error)  # the rest still runs; the page lists it
    report = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/run_all.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "torch": _torch_version()},
        "note": "CPU gloo ranks, one thread each, on a shared 2-core machine: timings are noisy "
                "and are not GPU figures; ratios compare systems measured in the same run.",
        "wall_s": {"total": time.perf_counter() - start, **walls},
        "settings": {job.key: f"{job.script} {' '.join(job.quick_args if args.quick else job.args)}"
                     for name in names if name in BENCHMARKS for job in BENCHMARKS[name]
                     if not (args.quick and job.full_only)},
        "failed": failed,
        "ratios": ratios(results, padding),
        "benchmarks": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[run_all] wrote {out} in {report['wall_s']['total']:.0f} s")
    if not (args.no_render or args.quick):
        from render_page import NOTES, read_notes, render

        render(report, HERE.parent / "docs", read_notes(NOTES) if NOTES.exists() else None)


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
