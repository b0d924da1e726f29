"""plan_buckets(): valid buckets, never worse than one buffer, and the LCM spikes it removes."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layout_planner import TensorSpec, plan, plan_buckets
from tests.layout_planner.validate import check_plan, rows_spec


def _check_split(buckets, specs, max_buckets: int) -> None:
    assert 1 <= len(buckets) <= max_buckets
    names = [e.name for b in buckets for e in b.entries]
    assert sorted(names) == sorted(s.name for s in specs), "each tensor in exactly one bucket"
    position = {s.name: i for i, s in enumerate(specs)}
    for b in buckets:
        members = [s for s in specs if s.name in {e.name for e in b.entries}]
        check_plan(b, members, keep_order=True)  # relative order kept inside a bucket
    firsts = [position[b.entries[0].name] for b in buckets]
    assert firsts == sorted(firsts), "buckets come in the order of their first tensor"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([1, 4, 7, 64, 96, 128])), min_size=1, max_size=10),
    st.integers(1, 64),
    st.sampled_from([1, 4]),
    st.integers(1, 4),
)
def test_random_splits_are_valid_and_never_worse(sizes, world: int, align: int, max_buckets: int) -> None:
    specs = [TensorSpec(f"t{i}", n, u) for i, (n, u) in enumerate(sizes)]
    buckets = plan_buckets(specs, world, align=align, max_buckets=max_buckets)
    _check_split(buckets, specs, max_buckets)
    assert sum(b.padding for b in buckets) <= plan(specs, world, align=align).padding


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([1, 4, 7, 64, 96])), min_size=1, max_size=7),
    st.integers(1, 16),
    st.integers(0, 2000),
)
def test_reordered_buckets_never_cost_more(sizes, world: int, cost: int) -> None:
    # the same splits are tried, and each bucket's plan tries its given order first
    specs = [TensorSpec(f"t{i}", n, u) for i, (n, u) in enumerate(sizes)]
    kept = plan_buckets(specs, world, align=4, bucket_cost=cost)
    moved = plan_buckets(specs, world, align=4, bucket_cost=cost, reorder=True)
    assert sorted(e.name for b in moved for e in b.entries) == sorted(s.name for s in specs)
    for b in moved:
        check_plan(b, [s for s in specs if s.name in {e.name for e in b.entries}], keep_order=False)
    assert (sum(b.padding for b in moved) + cost * (len(moved) - 1)
            <= sum(b.padding for b in kept) + cost * (len(kept) - 1))


def test_reorder_spares_a_llama_block_stage_its_padding() -> None:
    # fsdp's first backward stage of a d_model-1024 block at 4 ranks, with fsdp's bucket cost
    # (1 MiB per rank of fp32): one buffer either way, 512 elements of padding per rank in
    # module order and none reordered (the norm weights straddle two rank boundaries)
    d, f = 1024, 4096
    specs = [rows_spec("attn_norm", (d,), 1), rows_spec("mlp_norm", (d,), 1),
             *(rows_spec(n, (d, d), 1) for n in ("wq", "wk", "wv", "wo")), rows_spec("w_gate", (f, d), 1)]
    cost = 4 * (1 << 20) // 4
    kept = plan_buckets(specs, 4, align=4, bucket_cost=cost)
    moved = plan_buckets(specs, 4, align=4, bucket_cost=cost, reorder=True)
    assert [len(kept), len(moved)] == [1, 1]
    assert (kept[0].padding, moved[0].padding) == (4 * 512, 0)
    check_plan(moved[0], specs, keep_order=False)


def test_one_bucket_equals_plan() -> None:
    specs = [TensorSpec("a", 1000, 7), TensorSpec("b", 300, 3), TensorSpec("c", 17)]
    assert plan_buckets(specs, 8, align=4, max_buckets=1) == [plan(specs, 8, align=4)]


def test_llama3_8b_layer_buckets_remove_the_lcm_padding() -> None:
    h, f, kv = 4096, 14336, 1024
    shapes = {"in_norm": (h,), "q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "post_norm": (h,),
              "gate": (f, h), "up": (f, h), "down": (h, f)}
    specs = [rows_spec(n, s, 1) for n, s in shapes.items()]
    single = plan(specs, 1024, align=4)
    buckets = plan_buckets(specs, 1024, align=4)
    _check_split(buckets, specs, 4)
    assert single.padding_ratio > 0.076
    assert sum(b.padding for b in buckets) / single.numel < 0.01
    down = next(b for b in buckets if "down" in {e.name for e in b.entries})
    assert {e.name for e in down.entries} == {"down"}  # the 14,336-row tensor gets its own lattice


def test_mixtral_8x22b_layer_at_16rows_spec() -> None:
    # Our arithmetic in the issue: one buffer pads ~28% (S a multiple of lcm(16*6144, 16*16384)).
    h, f, kv = 6144, 16384, 1024
    specs = [rows_spec("in_norm", (h,), 16), rows_spec("q", (h, h), 16), rows_spec("k", (kv, h), 16), rows_spec("v", (kv, h), 16),
             rows_spec("o", (h, h), 16), rows_spec("post_norm", (h,), 16), rows_spec("router", (8, h), 16)]
    for e in range(8):
        specs += [rows_spec(f"e{e}.w1", (f, h), 16), rows_spec(f"e{e}.w2", (h, f), 16), rows_spec(f"e{e}.w3", (f, h), 16)]
    single = plan(specs, 1024, align=4)
    assert single.shard_size % math.lcm(16 * h, 16 * f) == 0
    assert 0.25 < single.padding_ratio < 0.31
    buckets = plan_buckets(specs, 1024, align=4)
    _check_split(buckets, specs, 4)
    assert sum(b.padding for b in buckets) / single.numel < 0.03


def test_bad_max_buckets() -> None:
    with pytest.raises(ValueError, match="max_buckets"):
        plan_buckets([TensorSpec("a", 4)], 2, max_buckets=0)


def test_bucket_cost_keeps_one_buffer_unless_a_split_saves_more_than_it_costs() -> None:
    h, f, kv = 4096, 14336, 1024
    shapes = {"in_norm": (h,), "q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h), "post_norm": (h,),
              "gate": (f, h), "up": (f, h), "down": (h, f)}
    specs = [rows_spec(n, s, 1) for n, s in shapes.items()]
    single = plan(specs, 1024, align=4)
    free = plan_buckets(specs, 1024, align=4)
    saving = single.padding - sum(b.padding for b in free)
    assert len(free) > 1 and saving > 0
    # one extra buffer must save at least bucket_cost padding elements to be chosen
    per_extra = saving // (len(free) - 1)
    assert plan_buckets(specs, 1024, align=4, bucket_cost=per_extra + 1) != free
    assert plan_buckets(specs, 1024, align=4, bucket_cost=10 * single.padding) == [single]
    assert len(plan_buckets(specs, 1024, align=4, bucket_cost=1)) > 1


@pytest.mark.parametrize("cost", [-1, 1.5, True])
def test_bad_bucket_cost(cost) -> None:
    with pytest.raises(ValueError, match="bucket_cost"):
        plan_buckets([TensorSpec("a", 4), TensorSpec("b", 4)], 2, bucket_cost=cost)
