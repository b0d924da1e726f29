"""Catalog shapes, unit rules, the comparison schemes, the report and the CLI."""

from __future__ import annotations

import time

import pytest

from layout_planner import TensorSpec, plan, plan_buckets
from layout_planner.catalog import catalog, get_model
from layout_planner.cli import main
from layout_planner.report import any_layout_padding_bound, fsdp2_padding, naive_lcm_padding, plan_model, report_group
from layout_planner.search import solve
from layout_planner.units import UnitRule, parse_unit
from tests.layout_planner.validate import check_plan


def test_catalog_parameter_counts_match_the_published_sizes() -> None:
    counts = {name: m.numel / 1e9 for name, m in catalog().items()}
    assert counts == pytest.approx(
        {"llama3-8b": 8.03, "llama3-70b": 70.55, "deepseek-v3": 671.03, "gpt-oss-120b": 116.83, "qwen3-30b-a3b": 30.53},
        abs=0.01,
    )
    moe = next(g for g in get_model("deepseek-v3").groups if g.name == "moe_layer")
    assert sum("experts." in n and "shared" not in n for n, _ in moe.tensors) == 3 * 256  # experts as separate tensors
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        get_model("gpt5")


@pytest.mark.parametrize(
    ("text", "shape", "unit"),
    [
        ("rows:1", (4096, 14336), 14336),
        ("rows:128", (128, 2880, 5760), 128 * 5760),  # a fused expert stack [E, r, c]: rows of c
        ("matrix", (128, 2880, 5760), 2880 * 5760),  # one expert of the stack
        ("matrix", (4096, 4096), 4096 * 4096),
        ("rows:16", (4096,), 1),  # 1-D tensors have no rows
        ("elements:256", (4096,), 256),
    ],
)
def test_unit_rules(text: str, shape: tuple[int, ...], unit: int) -> None:
    assert parse_unit(text).unit_for(shape) == unit
    assert str(parse_unit(text)) == text


@pytest.mark.parametrize("text", ["rows", "rows:0", "rows:x", "cols:2", "matrix:2", ""])
def test_bad_unit_rules(text: str) -> None:
    with pytest.raises(ValueError):
        parse_unit(text)


def test_fsdp2_padding_by_hand() -> None:
    specs = [TensorSpec("w", 10 * 3, 1, (10, 3)), TensorSpec("b", 5, 1, (5,))]
    assert fsdp2_padding(specs, 4) == (12 - 10) * 3 + (8 - 5)


def test_naive_lcm_by_hand() -> None:
    # Units 4 and 6: S is a multiple of 12; tensors start on multiples of their unit.
    specs = [TensorSpec("a", 8, 4), TensorSpec("b", 12, 6)]
    # a at 0..8, b at 12..24 -> 24 elements on 2 ranks -> S = 12 -> padding 4.
    assert naive_lcm_padding(specs, 2, 1) == 4


def test_any_layout_bound_by_hand() -> None:
    # 'big' has 4 units of 100: in any bucket S >= 100, so 8 ranks hold >= 800 for 410 elements.
    specs = [TensorSpec("big", 400, 100), TensorSpec("small", 10)]
    assert any_layout_padding_bound(specs, 8, 4) == 8 * 100 - 410
    assert any_layout_padding_bound([TensorSpec("x", 1000)], 8, 4) == 8 * 128 - 1000  # 125 rounded to align 4
    best = min(sum(b.padding for b in plan_buckets(specs, 8, align=4, max_buckets=k)) for k in (1, 2))
    assert best >= 8 * 100 - 410


def test_report_orders_the_schemes_and_bounds() -> None:
    layer = next(g for g in get_model("llama3-8b").groups if g.name == "layer")
    r = report_group("llama3-8b", layer, 1024, parse_unit("rows:1"), align=4)
    assert r.bound_any <= r.bound <= r.plan and r.buckets <= r.plan
    assert r.shard_size % 28672 == 0 and r.ratio("plan") == pytest.approx(0.0769, abs=5e-4)
    assert r.ratio("buckets") < 0.01


def test_whole_llama3_70b_at_16384_ranks_plans_each_distinct_group_once() -> None:
    model = get_model("llama3-70b")
    solve.cache_clear()
    start = time.perf_counter()
    plans = plan_model(model, 16384, UnitRule("rows", 1), align=4)
    elapsed = time.perf_counter() - start
    assert len(plans) == 82 and solve.cache_info().misses == 3
    assert elapsed < 1.0  # target 0.3 s on a quiet machine (benchmarks/planner.py); slack for shared CI
    layer = next(g for g in model.groups if g.name == "layer")
    first_layer = [TensorSpec("layer.0." + s.name, s.numel, s.unit, s.shape) for s in layer.specs(UnitRule("rows"))]
    check_plan(plans[1], first_layer, keep_order=True)


def test_deepseek_v3_moe_layer_plans_fast() -> None:
    specs = next(g for g in get_model("deepseek-v3").groups if g.name == "moe_layer").specs(UnitRule("rows", 1))
    solve.cache_clear()
    start = time.perf_counter()
    p = plan(specs, 1024, align=4)
    assert time.perf_counter() - start < 1.0  # target 0.3 s (benchmarks/planner.py)
    assert p.padding_ratio < 0.03 and len(p.entries) == 782


def test_cli_report_prints_every_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "llama3-70b", "--world-size", "256", "--unit", "rows:128"]) == 0
    out = capsys.readouterr().out
    for column in ("plan", "buckets", "fsdp2", "naive-lcm", "bound", "t-plan"):
        assert column in out.splitlines()[0]
    assert "llama3-70b" in out and "MODEL" in out


def test_cli_train_invocation_is_quick(capsys: pytest.CaptureFixture[str]) -> None:
    # hatch.toml's `train` script: the whole catalog at four world sizes.
    start = time.perf_counter()
    assert main(["report", "--model", "all", "--world-size", "8,64,256,1024", "--unit", "rows:1"]) == 0
    assert time.perf_counter() - start < 30
    out = capsys.readouterr().out
    assert all(name in out for name in catalog())


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["report", "--model", "nope", "--world-size", "8"], ["report", "--world-size", "0"],
                 ["report", "--world-size", "8", "--unit", "cols:1"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert main(["models"]) == 0
    assert "deepseek-v3" in capsys.readouterr().out
