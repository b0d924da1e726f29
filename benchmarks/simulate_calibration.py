"""Calibrate the simulator's alpha-beta ring model on gloo, and test it on held-out points.

Measures ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` on 4 spawned CPU gloo
ranks (one thread each), on subgroups of world sizes 2, 3 and 4, at several per-rank message
sizes, every repetition visiting every point in turn (see ``_measure``). For each point it
takes the median over repetitions of the slowest rank's wall time (messages under 1 MiB run
several collectives back to back per timing, divided by their number). Then, per collective,
it fits ``t = (m - 1) * (alpha + chunk_bytes / beta)`` with
:func:`layout_planner.comm_model.fit_link` on a training subset (world sizes 2 and 4, all but
one message size) and reports the relative prediction error on the held-out points (world
size 3 at every size, and the held-out size at 2 and 4). The whole measurement runs twice so
the spread between runs shows the machine's noise.

Gloo over loopback on a shared 2-core machine is not a ring over real links: the fit checks
the model's form (linear in ``m - 1`` and in the chunk size), it says nothing about GPUs.

Run: ``python benchmarks/simulate_calibration.py [--runs 2] [--reps 9]``; writes
``benchmarks/results/simulate_calibration.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.append(str(_HERE))

from gloo_ranks import run_on_gloo_ranks  # noqa: E402

from layout_planner.comm_model import fit_link  # noqa: E402

WORLDS = (2, 3, 4)
TRAIN_WORLDS = (2, 4)
ELEMENTS = (1024, 16384, 65536, 262144, 1048576)  # fp32 per rank: 4 KiB .. 4 MiB
HELD_OUT_ELEMENTS = 65536
BATCH_ELEMENTS = 262144  # sizes below this run several collectives per timing (at most 32)
COLLECTIVES = ("all_gather", "reduce_scatter")
RESULTS = _HERE / "results" / "simulate_calibration.json"


def _batch(elements: int) -> int:
    """Collectives per timed repetition: small messages run back to back so that one timing
    spans milliseconds, not the scheduler's jitter."""
    return max(1, min(32, BATCH_ELEMENTS // elements))


def _measure(elements: tuple[int, ...], reps: int) -> dict[str, dict[int, dict[int, list[float]]]]:
    """On every rank of ``max(WORLDS)``: per collective, world size and message size, the slowest
    rank's seconds per collective in each repetition.

    The smaller world sizes run on subgroups of the first ranks, and every repetition visits
    every (world, size, collective) point once, so a busy spell of the shared machine lands on
    all points alike instead of on whichever point was being measured at the time.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = {w: dist.new_group(list(range(w))) for w in WORLDS}
    buffers = {(w, n): (torch.randn(n), torch.empty(w * n)) for w in WORLDS for n in elements}
    points = [(c, w, n) for w in WORLDS for n in elements for c in COLLECTIVES]
    times = torch.zeros(len(points), reps, dtype=torch.float64)
    for i in range(reps + 2):  # two warm-up rounds
        for k, (name, w, n) in enumerate(points):
            dist.barrier()
            if rank >= w:
                continue
            shard, full = buffers[(w, n)]
            batch = _batch(n)
            start = time.perf_counter()
            for _ in range(batch):
                if name == "all_gather":
                    dist.all_gather_single(full, shard, group=groups[w])
                else:
                    dist.reduce_scatter_single(shard, full, group=groups[w])
            if i >= 2:
                times[k, i - 2] = (time.perf_counter() - start) / batch
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # ranks outside a point's group hold 0
    out: dict[str, dict[int, dict[int, list[float]]]] = {c: {w: {} for w in WORLDS} for c in COLLECTIVES}
    for k, (name, w, n) in enumerate(points):
        out[name][w][n] = times[k].tolist()
    return out


def measure(reps: int) -> dict[str, dict[int, dict[int, list[float]]]]:
    """``{collective: {world: {elements: [seconds per repetition]}}}`` over ``WORLDS``."""
    return run_on_gloo_ranks(_measure, max(WORLDS), ELEMENTS, reps)


def fit_and_test(medians: dict[int, dict[int, float]]) -> dict[str, Any]:
    """Fit on the training points and score every point; ``medians[world][elements]`` in seconds."""
    points = [(w, n, medians[w][n]) for w in WORLDS for n in ELEMENTS]
    train = [(w, 4 * n, t) for w, n, t in points if w in TRAIN_WORLDS and n != HELD_OUT_ELEMENTS]
    link = fit_link(train)
    rows = []
    for w, n, t in points:
        predicted = (w - 1) * link.step_time(4 * n)
        held_out = w not in TRAIN_WORLDS or n == HELD_OUT_ELEMENTS
        rows.append({"world_size": w, "elements": n, "bytes": 4 * n, "measured_s": t, "predicted_s": predicted,
                     "rel_error": predicted / t - 1, "held_out": held_out})
    held = [abs(r["rel_error"]) for r in rows if r["held_out"]]
    fitted = [abs(r["rel_error"]) for r in rows if not r["held_out"]]
    return {
        "alpha_s": link.latency,
        "beta_bytes_per_s": link.bandwidth,
        "points": rows,
        "held_out_median_abs_rel_error": statistics.median(held),
        "held_out_max_abs_rel_error": max(held),
        "train_median_abs_rel_error": statistics.median(fitted),
        "train_max_abs_rel_error": max(fitted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="whole measurements, to show the noise (default 2)")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per point (default 9)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = []
    for run in range(args.runs):
        start = time.perf_counter()
        raw = measure(args.reps)
        fits = {}
        for c in COLLECTIVES:
            medians = {w: {n: statistics.median(raw[c][w][n]) for n in ELEMENTS} for w in WORLDS}
            fits[c] = fit_and_test(medians)
            f = fits[c]
            print(f"run {run} {c:14}: alpha {1e6 * f['alpha_s']:8.1f} us  "
                  f"beta {f['beta_bytes_per_s'] / 1e9:6.3f} GB/s  "
                  f"held-out |err| median {100 * f['held_out_median_abs_rel_error']:5.1f}% "
                  f"max {100 * f['held_out_max_abs_rel_error']:5.1f}%  "
                  f"train |err| median {100 * f['train_median_abs_rel_error']:5.1f}%")
            for p in f["points"]:
                tag = "held-out" if p["held_out"] else "train"
                print(f"    m={p['world_size']} {p['bytes'] / 1024:7.0f} KiB  "
                      f"measured {1e3 * p['measured_s']:8.3f} ms  predicted {1e3 * p['predicted_s']:8.3f} ms  "
                      f"{100 * p['rel_error']:+6.1f}%  {tag}")
        runs.append({"seconds": time.perf_counter() - start, "fits": fits,
                     "samples": {c: {str(w): {str(n): v for n, v in raw[c][w].items()} for w in WORLDS}
                                 for c in COLLECTIVES}})
    spread = {}
    for c in COLLECTIVES:
        ratios = [max(r["fits"][c]["points"][i]["measured_s"] for r in runs)
                  / min(r["fits"][c]["points"][i]["measured_s"] for r in runs)
                  for i in range(len(WORLDS) * len(ELEMENTS))]
        spread[c] = {"median_max_over_min": statistics.median(ratios), "max_max_over_min": max(ratios)}
        print(f"{c}: run-to-run spread of the medians (max/min): median {spread[c]['median_max_over_min']:.2f}, "
              f"worst {spread[c]['max_max_over_min']:.2f}")
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "shared 2-core machine, other jobs running: noisy"},
        "model": "t = (m - 1) * (alpha + chunk_bytes / beta), chunk = one rank's fp32 shard",
        "train": {"world_sizes": list(TRAIN_WORLDS), "elements": [n for n in ELEMENTS if n != HELD_OUT_ELEMENTS]},
        "held_out": {"world_sizes": [w for w in WORLDS if w not in TRAIN_WORLDS], "elements": [HELD_OUT_ELEMENTS]},
        "reps": args.reps,
        "runs": runs,
        "run_spread": spread,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
