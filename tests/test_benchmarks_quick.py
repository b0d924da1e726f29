"""benchmarks/run_all.py's ratios and benchmarks/render_page.py's page, on synthetic results.

The real benchmarks take minutes; here every script's JSON is a small synthetic one with known
figures, the padding sweep is the real one at two world sizes, and the test checks that the
ratios the issue asks for come out right and that the page and its plots are written; the
committed page must be the rendering of the committed results and notes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark


def _side(step_ms: float, peak: int, copied: int) -> dict[str, float]:
    return {"median_step_ms": step_ms, "peak_rss_over_baseline_bytes": peak,
            "copy_bytes_per_step": copied}


def _train_step(scale: float) -> dict[str, object]:
    modes = {}
    for mode in ("fp32", "bf16_compute_fp32_reduce"):
        ours, theirs = _side(90 * scale, 80 << 20, 1 << 20), _side(100 * scale, 100 << 20, 4 << 20)
        modes[mode] = {"fsdp": ours, "fsdp2": theirs, "ratios_ours_over_fsdp2": {
            "step_time": 0.9, "peak_memory": 0.8, "copy_bytes": 0.25}}
    return {"modes": modes}


def _copies(issued: int) -> dict[str, object]:
    return {op: {"issued": {"bytes": issued}, "backend": {"bytes": 7}}
            for op in ("all_gather", "reduce_scatter")}


def _results() -> dict[str, object]:
    results: dict[str, object] = {f"train_step_{m}_ws{w}": _train_step(w)
                                  for m in ("dense", "moe") for w in (2, 4)}
    dbuffer_modes = {mode: {"dbuffer": {"total_ms": 3.0, "copies": _copies(0)},
                            "fsdp2": {"total_ms": 6.0, "copies": _copies(5 << 20)}}
                     for mode in ("fp32", "bf16_compute_fp32_reduce")}
    results["dbuffer"] = {"modes": dbuffer_modes}
    results["optim_muon"] = {"median_step_s": {"ours": 1.0, "fsdp2_torch_muon": 4.0, "replicated": 2.0}}
    results["optim_adamw8bit"] = {"state_bytes_ratio": 0.254, "step_time_ratio": 2.5}
    results["ragged_redistribute"] = {"rows": [{"ragged": "RaggedShard -> Replicate",
                                                "torch": "Shard(0) -> Replicate", "ratio": 1.1}]}
    results["ragged_handlers"] = {"rows": [{"op": "add", "placement": "Shard(0)", "ratio": r}
                                           for r in (1.0, 1.2, 1.4)],
                                  "wrapper_work": [{"bound_ratio": b} for b in (1.01, 1.03)]}
    return results


def test_ratios_and_page(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_all, render_page = load_benchmark("run_all"), load_benchmark("render_page")
    padding = run_all.padding_sweep([8, 1024])
    ratios = run_all.ratios(_results(), padding)

    for model in ("dense", "moe"):
        for mode in ("fp32", "bf16"):
            for world in ("2", "4"):
                r = ratios["train_step"][model][mode][world]
                assert (r["step_time"], r["peak_memory"], r["copy_bytes"]) == (0.9, 0.8, 0.25)
                c = ratios["copy_bytes_per_step"]["train_step"][model][mode][world]
                assert (c["fsdp"], c["fsdp2"], c["ratio"]) == (1 << 20, 4 << 20, 0.25)
    assert ratios["dbuffer_time"] == {"fp32": 0.5, "bf16": 0.5}
    assert ratios["copy_bytes_per_step"]["dbuffer_layer"]["fp32"] == {
        "dbuffer": 0, "fsdp2": 10 << 20, "ratio": 0.0}
    assert ratios["muon_step_time"]["ours_over_fsdp2_torch_muon"] == 0.25
    assert ratios["ragged_handlers"]["median_with_over_without"] == 1.2
    assert ratios["ragged_handlers"]["wrapper_bound"] == 1.03
    # FSDP2's whole-model padding recomputed by hand: every tensor's dim 0 up to the world size
    from layout_planner.catalog import get_model
    from layout_planner.units import parse_unit

    model, pad, total = get_model("llama3-8b"), 0, 0
    for group in model.groups:
        for spec in group.specs(parse_unit("rows:1")):
            rows = spec.shape[0]
            pad += group.count * (-rows % 1024) * (spec.numel // rows)
            total += group.count * spec.numel
    assert padding["llama3-8b"]["1024"]["fsdp2"] == pytest.approx(pad / total)
    # LLaMA-3-8B at 1024 ranks: one plan per layer pads 7.69% of a layer, buckets almost nothing
    assert padding["llama3-8b"]["1024"]["single_plan"] > 0.05 > 0.002 > padding["llama3-8b"]["1024"]["ours"]
    for by_world in padding.values():
        for p in by_world.values():
            assert p["bound"] <= p["ours"] <= p["fsdp2"] + 0.01

    report = {"when": "2026-01-01T00:00:00+00:00", "command": "python benchmarks/run_all.py",
              "quick": False, "wall_s": {"total": 600.0}, "failed": {"optim_muon": "boom"},
              "settings": {"dbuffer": "dbuffer.py --iters 10"},
              "machine": {"platform": "Linux", "cpu_count": 2, "python": "3.12", "torch": "2.13"},
              "ratios": ratios}
    page = render_page.render(report, tmp_path).read_text()
    assert "not GPU figures" in page and "2026-01-01" in page
    assert "| dense | fp32 | 2 | 180.0 | 200.0 | 0.90 | 80.0 | 100.0 | 0.80 | 1.00 | 4.00 |" in page
    llama = padding["llama3-8b"]["1024"]
    assert f"| llama3-8b | 1024 | {100 * llama['ours']:.2f}% | {100 * llama['single_plan']:.2f}% |" in page
    assert "`optim_muon`" in page and "`dbuffer.py --iters 10`" in page
    for name in ("step_time_ratio", "memory_ratio", "padding"):
        png = tmp_path / "img" / "benchmarks" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"img/benchmarks/{name}.png" in page


def test_notes_render_in_their_sections_and_unknown_ones_raise(tmp_path: Path) -> None:
    render_page = load_benchmark("render_page")
    notes = tmp_path / "notes.md"
    notes.write_text("intro, not rendered\n## settings\n\nSETTINGS NOTE\n\n## hook_overhead\nHOOK NOTE\n")
    assert render_page.read_notes(notes) == {"settings": ["SETTINGS NOTE", ""],
                                             "hook_overhead": ["HOOK NOTE", ""]}
    notes.write_text("## nowhere\ntext\n")
    with pytest.raises(ValueError, match="nowhere"):
        render_page.read_notes(notes)


def test_the_committed_page_is_the_rendering_of_its_sources(tmp_path: Path) -> None:
    """docs/benchmarks.md says "do not edit by hand": it must be what render_page.py makes
    of results/all.json and page_notes.md, so a new run loses nothing written since."""
    pytest.importorskip("matplotlib")
    render_page = load_benchmark("render_page")
    report = json.loads((render_page.HERE / "results" / "all.json").read_text())
    page = render_page.render(report, tmp_path, render_page.read_notes(render_page.NOTES))
    committed = render_page.HERE.parent / "docs" / "benchmarks.md"
    assert page.read_text() == committed.read_text()
