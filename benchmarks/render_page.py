"""Render ``benchmarks/results/all.json`` (written by ``run_all.py``) as ``docs/benchmarks.md``
with PNG plots under ``docs/img/benchmarks/``.

The page is generated: edit this renderer, not the page. What was measured after the run
(a later release's figures, context a reader needs) goes in ``benchmarks/page_notes.md``, one
``## <section>`` per place on the page (``settings``, ``train_step``, ``memory``,
``hook_overhead``), and is rendered there, so a new run keeps it. Plots use matplotlib's Agg
backend, so no display is needed.

    python benchmarks/render_page.py [--results benchmarks/results/all.json] [--docs docs]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
IMG = Path("img") / "benchmarks"
MB = 2**20
NOTES = HERE / "page_notes.md"
NOTE_SECTIONS = ("settings", "train_step", "memory", "hook_overhead")


def read_notes(path: Path) -> dict[str, list[str]]:
    """The notes of ``path`` by section: the lines under each ``## <section>`` header.

    Raises:
        ValueError: for a section the page has no place for.
    """
    notes: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            if name not in NOTE_SECTIONS:
                raise ValueError(f"{path}: unknown section {name!r}; one of {NOTE_SECTIONS}")
            current = notes.setdefault(name, [])
        elif current is not None:
            current.append(line)
    return {name: _strip_blank(lines) + [""] for name, lines in notes.items()}


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "cut" if value is None else f"{100 * value:.2f}%"


def _train_rows(train: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, figures) per model, ranks and precision, in a stable order."""
    rows = []
    for model, by_mode in train.items():
        for mode, by_world in by_mode.items():
            for world, figures in sorted(by_world.items(), key=lambda kv: int(kv[0])):
                rows.append((f"{model} {mode} {world}r", figures))
    return rows


def _bar_plot(rows: list[tuple[str, dict[str, Any]]], key: str, title: str, path: Path) -> None:
    labels = [label for label, _ in rows]
    values = [figures[key] for _, figures in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(labels)), 3.6))
    ax.bar(range(len(values)), values, color=["#3b75af" if v <= 1 else "#c44e52" for v in values])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("fsdp / FSDP2 (lower is better)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _padding_plot(padding: dict[str, Any], path: Path) -> None:
    schemes = {"ours": "fsdp (plan_buckets)", "fsdp2": "FSDP2", "row_aligned": "row-aligned (LCM)",
               "bound": "lower bound"}
    fig, axes = plt.subplots(1, len(padding), figsize=(3.2 * len(padding), 3.4), squeeze=False,
                             sharey=True)
    for ax, (model, by_world) in zip(axes[0], padding.items()):
        worlds = sorted(by_world, key=int)
        for key, label in schemes.items():
            points = [(int(w), 100 * by_world[w][key]) for w in worlds if by_world[w][key] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("world size")
    axes[0][0].set_ylabel("padding, % of parameters")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _train_section(ratios: dict[str, Any], img: Path, notes: dict[str, list[str]]) -> list[str]:
    rows = _train_rows(ratios["train_step"])
    _bar_plot(rows, "step_time", "Training step time, fsdp / FSDP2", img / "step_time_ratio.png")
    _bar_plot(rows, "peak_memory", "Peak memory over baseline, fsdp / FSDP2",
              img / "memory_ratio.png")
    copies = ratios["copy_bytes_per_step"]["train_step"]
    lines = ["## Training step: fsdp vs FSDP2", "",
             "`benchmarks/train_step.py`: a LLaMA-style model (dense SwiGLU, or MoE: 4 experts, "
             "top-2, fused 3-D expert weights, one expert per fsdp unit), each block then the "
             "root sharded, `torch.optim.AdamW`; fp32, and bf16 compute with fp32 reduction. "
             "Step time: median of the slowest rank; peak: resident memory over the baseline "
             "(largest rank); copied: bytes the system's own copy ops write in one step, outside "
             "the communication backend, minus the model's own copies.", "",
             "| model | precision | ranks | fsdp ms | FSDP2 ms | time ratio | fsdp peak MB "
             "| FSDP2 peak MB | memory ratio | fsdp copied MB | FSDP2 copied MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, by_mode in ratios["train_step"].items():
        for mode, by_world in by_mode.items():
            for world, f in sorted(by_world.items(), key=lambda kv: int(kv[0])):
                c = copies[model][mode][world]
                lines.append(
                    f"| {model} | {mode} | {world} | {f['fsdp_step_ms']:.1f} | "
                    f"{f['fsdp2_step_ms']:.1f} | {f['step_time']:.2f} | "
                    f"{f['fsdp_peak_bytes'] / MB:.1f} | {f['fsdp2_peak_bytes'] / MB:.1f} | "
                    f"{f['peak_memory']:.2f} | {c['fsdp'] / MB:.2f} | {c['fsdp2'] / MB:.2f} |")
    lines += [""] + notes.get("train_step", [])
    lines += [f"![Step time ratio]({(IMG / 'step_time_ratio.png').as_posix()})", "",
              f"![Memory ratio]({(IMG / 'memory_ratio.png').as_posix()})", ""]
    return lines


def _components_section(ratios: dict[str, Any]) -> list[str]:
    lines = ["## Components", "", "| benchmark | figure | ratio |", "|---|---|---:|"]
    for mode, value in ratios.get("dbuffer_time", {}).items():
        lines.append(f"| `dbuffer.py` | all-gather + reduce-scatter time, DBuffer / FSDP2, {mode} "
                     f"| {_fmt(value)} |")
    for mode, c in ratios.get("copy_bytes_per_step", {}).get("dbuffer_layer", {}).items():
        lines.append(f"| `dbuffer.py` | bytes copied outside gloo per AG + RS of one layer, {mode}: "
                     f"DBuffer {c['dbuffer'] / MB:.2f} MB, FSDP2 {c['fsdp2'] / MB:.2f} MB "
                     f"| {_fmt(c['ratio'])} |")
    if "muon_step_time" in ratios:
        m = ratios["muon_step_time"]
        lines.append("| `optim.py` | Muon step time, block_optim.Muon / FSDP2 + torch.optim.Muon "
                     f"| {m['ours_over_fsdp2_torch_muon']:.2f} |")
        lines.append("| `optim.py` | Muon step time, block_optim.Muon / every rank every matrix "
                     f"| {m['ours_over_replicated']:.2f} |")
    if "adamw8bit" in ratios:
        a = ratios["adamw8bit"]
        lines.append(f"| `optim_adamw8bit.py` | optimizer state bytes, AdamW8bit / AdamW "
                     f"| {a['state_bytes']:.3f} |")
        lines.append(f"| `optim_adamw8bit.py` | step time, AdamW8bit / AdamW | {a['step_time']:.2f} |")
    for name, value in ratios.get("ragged_redistribute", {}).items():
        lines.append(f"| `ragged_redistribute.py` | {name} (time) | {_fmt(value)} |")
    if "ragged_handlers" in ratios:
        lines.append("| `ragged_handlers.py` | DTensor op time with / without `import ragged_dtensor`"
                     f", median over ops | {ratios['ragged_handlers']['median_with_over_without']:.2f} |")
    return lines + [""]


def _memory_plot(memory: dict[str, Any], path: Path) -> None:
    """Per-phase live bytes, fsdp next to FSDP2, one panel per configuration."""
    phases = ("forward", "backward", "optimizer", "between")
    cols = min(4, len(memory))
    rows = (len(memory) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, (key, entry) in zip(axes.flat, memory.items()):
        for offset, system, label, color in ((-0.2, "fsdp_bytes", "fsdp", "#3b75af"),
                                             (0.2, "fsdp2_bytes", "FSDP2", "#999999")):
            ax.bar([x + offset for x in range(len(phases))],
                   [entry[system][p] / MB for p in phases], width=0.4, color=color, label=label)
        ax.set_xticks(range(len(phases)), phases, fontsize=7)
        ax.set_title(f"{key} (peak {entry['ratios']['peak']:.2f}x)", fontsize=8)
        ax.set_ylabel("allocator MB", fontsize=7)
    for ax in list(axes.flat)[len(memory):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _memory_section(ratios: dict[str, Any], img: Path,
                    notes: dict[str, list[str]]) -> list[str]:
    lines = ["## Memory per phase: fsdp vs FSDP2", ""]
    memory = ratios.get("memory")
    if memory:
        _memory_plot(memory, img / "memory_phases.png")
        lines += [
            "`benchmarks/memory.py`: the CPU allocator's live bytes (c10's memory reports "
            "through `torch.profiler`, the analogue of `torch.cuda.memory_allocated`; FSDP2 "
            "against itself reads 1.00), each block then the root sharded, "
            "`torch.optim.AdamW`, peak of each phase of a step after two warm-up steps "
            "(smallest over the measured steps, largest rank); `between`: live bytes after "
            "`zero_grad(set_to_none=True)`. `llama1024`: 4 blocks, d_model 1024, seq 16, batch "
            "1 per rank (parameters dominate); `train_step`: `train_step.py`'s model "
            "(activations dominate).", "",
            f"![Memory per phase]({(IMG / 'memory_phases.png').as_posix()})", "",
            *notes.get("memory", []),
            "| model precision ranks | phase | fsdp MB | FSDP2 MB | ratio |",
            "|---|---|---:|---:|---:|"]
        for key, entry in memory.items():
            for phase, ratio in entry["ratios"].items():
                if phase == "peak":
                    continue
                lines.append(f"| {key} | {phase} | {entry['fsdp_bytes'][phase] / MB:.1f} | "
                             f"{entry['fsdp2_bytes'][phase] / MB:.1f} | {ratio:.2f} |")
        diffs = {k: e["difference_bytes"] for k, e in memory.items() if "difference_bytes" in e}
        for key, by_phase in diffs.items():
            categories = list(next(iter(by_phase.values())))
            lines += ["", f'??? note "Where fsdp holds more: {key}, MB, fsdp minus FSDP2 at '
                      'each phase peak (`memory.py --breakdown`)"',
                      "    | category | " + " | ".join(by_phase) + " |",
                      "    |---|" + "---:|" * len(by_phase)]
            lines += [f"    | {c} | " + " | ".join(f"{by_phase[p][c] / MB:.1f}" for p in by_phase)
                      + " |" for c in categories]
        lines.append("")
    if "hook_overhead" in ratios:
        h = ratios["hook_overhead"]
        lines += [
            "`benchmarks/hook_overhead.py`: CPU time of the training thread inside each "
            "system's hooks per step (waiting on gloo excluded), 8 blocks of 24 small "
            f"`nn.Linear`: fsdp {h['fsdp_ms']:.1f} ms, FSDP2 {h['fsdp2_ms']:.1f} ms, ratio "
            f"{h['ratio']:.2f}.", "", *notes.get("hook_overhead", [])]
    return lines


def _padding_section(padding: dict[str, Any], img: Path) -> list[str]:
    _padding_plot(padding, img / "padding.png")
    lines = ["## Padding across world sizes", "",
             "Whole-model padding as a share of the parameters (units: rows): this planner "
             "(`plan_buckets`, what `fsdp.fully_shard` uses; `plan`: one buffer per group), "
             "FSDP2 (each tensor's dim 0 padded to a multiple of the world size), a row-aligned "
             "scheme in the style of Megatron-FSDP (every tensor on its row lattice, shards a "
             "multiple of the LCM of the row sizes; `cut` where it would split an indivisible "
             "tensor) and the lower bound no layout can beat.", "",
             f"![Padding vs world size]({(IMG / 'padding.png').as_posix()})", "",
             "| model | world size | fsdp (buckets) | fsdp (one plan) | FSDP2 | row-aligned | bound |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for model, by_world in padding.items():
        for world in sorted(by_world, key=int):
            p = by_world[world]
            lines.append(f"| {model} | {world} | {_pct(p['ours'])} | {_pct(p['single_plan'])} | "
                         f"{_pct(p['fsdp2'])} | {_pct(p['row_aligned'])} | {_pct(p['bound'])} |")
    return lines + [""]


def render(report: dict[str, Any], docs: Path,
           notes: dict[str, list[str]] | None = None) -> Path:
    """Write ``docs/benchmarks.md`` and its plots from a ``run_all.py`` report, with ``notes``
    (:func:`read_notes`) in their sections; the page's path."""
    notes = notes or {}
    img = docs / IMG
    img.mkdir(parents=True, exist_ok=True)
    ratios = report["ratios"]
    machine = report["machine"]
    lines = [
        "# Benchmarks", "",
        "Generated by `benchmarks/render_page.py` from `benchmarks/results/all.json` and the "
        "notes measured since, `benchmarks/page_notes.md`; do not edit by hand.", "",
        '!!! warning "CPU figures, not GPU figures"',
        "    Every timing here comes from CPU gloo ranks (one thread each) on a shared 2-core "
        "machine. They are noisy and say nothing about GPU step times; ratios compare systems "
        "measured side by side in the same run. Memory and copied-byte figures depend less on "
        "the machine.", "",
        f"- Date: {report['when']}",
        f"- Command: `{report['command']}`" + (" (quick smoke settings)" if report["quick"] else ""),
        f"- Machine: {machine['platform']}, {machine['cpu_count']} CPUs, Python "
        f"{machine['python']}, torch {machine['torch']}",
        f"- Wall time: {report['wall_s']['total'] / 60:.1f} min", "",
        "Ratios are ours / the reference: below 1 is better for us.", "",
    ]
    if report.get("settings"):
        lines += ['??? note "Each script\'s settings in this run"']
        lines += [f"    - `{key}`: `{cmd}`" for key, cmd in report["settings"].items()] + [""]
        lines += notes.get("settings", [])
    if report.get("failed"):
        lines += ["Benchmarks that failed in this run: "
                  + ", ".join(f"`{k}`" for k in report["failed"]) + ".", ""]
    if "train_step" in ratios:
        lines += _train_section(ratios, img, notes)
    if "memory" in ratios or "hook_overhead" in ratios:
        lines += _memory_section(ratios, img, notes)
    lines += _components_section(ratios)
    if "padding" in ratios:
        lines += _padding_section(ratios["padding"], img)
    page = docs / "benchmarks.md"
    page.write_text("\n".join(lines).rstrip() + "\n")
    return page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results" / "all.json")
    parser.add_argument("--docs", type=Path, default=HERE.parent / "docs")
    parser.add_argument("--notes", type=Path, default=NOTES)
    args = parser.parse_args()
    notes = read_notes(args.notes) if args.notes.exists() else {}
    print(f"wrote {render(json.loads(args.results.read_text()), args.docs, notes)}")


if __name__ == "__main__":
    main()
