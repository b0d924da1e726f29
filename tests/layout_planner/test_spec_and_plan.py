"""TensorSpec validation and the Plan's own methods, on hand-computed examples."""

from __future__ import annotations

import pytest

from layout_planner import Plan, PlanEntry, TensorSpec, plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "w", "numel": 0}, "'w': numel"),
        ({"name": "w", "numel": -3}, "'w': numel"),
        ({"name": "w", "numel": 4, "unit": 0}, "'w': unit"),
        ({"name": "w", "numel": True}, "'w': numel"),
        ({"name": "w", "numel": 4.0}, "'w': numel"),
        ({"name": "w", "numel": 6, "shape": (2, 2)}, "'w': shape"),
        ({"name": "w", "numel": 0, "shape": (0, 2)}, "'w'"),
        ({"name": "", "numel": 4}, "non-empty"),
    ],
)
def test_spec_rejects_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorSpec(**kwargs)


def test_spec_normalises_shape_to_tuple() -> None:
    assert TensorSpec("w", 6, 2, [2, 3]).shape == (2, 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: plan([TensorSpec("a", 4), TensorSpec("a", 5)], 2), "duplicate tensor name 'a'"),
        (lambda: plan([TensorSpec("a", 4)], 0), "world_size"),
        (lambda: plan([TensorSpec("a", 4)], 2, align=0), "align"),
    ],
)
def test_plan_rejects_bad_input(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_plan_rejects_non_specs() -> None:
    with pytest.raises(TypeError, match="TensorSpec"):
        plan([("a", 4)], 2)  # type: ignore[list-item]


def _hand_plan() -> Plan:
    # 4 ranks of 8: a=[0,6) unit 3, b=[6,18) unit 4 (cut at 8 is 2 in: bad) -> the planner must avoid it.
    return Plan(
        world_size=4,
        shard_size=8,
        entries=(PlanEntry("a", 0, 6, 3, (2, 3)), PlanEntry("b", 8, 20, 4, (5, 4)), PlanEntry("c", 28, 3, 1, None)),
        align=2,
    )


def test_local_range_by_hand() -> None:
    p = _hand_plan()
    assert p.padding == 32 - 29
    assert [p.local_range("b", r) for r in range(4)] == [(0, 0), (0, 8), (8, 16), (16, 20)]
    assert [p.local_range("c", r) for r in range(4)] == [(0, 0), (0, 0), (0, 0), (0, 3)]
    assert [p.local_range("a", r) for r in range(4)] == [(0, 6), (0, 0), (0, 0), (0, 0)]
    with pytest.raises(KeyError, match="'zz'"):
        p.entry("zz")
    with pytest.raises(ValueError, match="rank 4"):
        p.local_range("a", 4)


def test_json_round_trip_and_fingerprint() -> None:
    p = _hand_plan()
    q = Plan.from_json(p.to_json())
    assert q == p and q.fingerprint() == p.fingerprint()
    assert len(p.fingerprint()) == 64
    other = Plan(4, 8, p.entries[:2], 2)
    assert other.fingerprint() != p.fingerprint()


@pytest.mark.parametrize(
    ("entries", "shard", "message"),
    [
        ((PlanEntry("b", 6, 20, 4, None),), 8, "'b': rank boundary 8 cuts"),
        ((PlanEntry("a", 0, 6, 1, None), PlanEntry("b", 4, 2, 1, None)), 8, "'b': offset 4 overlaps"),
        ((PlanEntry("a", 1, 6, 1, None),), 8, "'a': offset 1 is not a multiple of align 2"),
        ((PlanEntry("a", 0, 40, 1, None),), 8, "'a' ends at 40"),
        ((PlanEntry("a", 0, 4, 1, None),), 7, "shard size 7"),
        ((PlanEntry("a", 0, 4, 1, None), PlanEntry("a", 4, 4, 1, None)), 8, "'a' appears twice"),
    ],
)
def test_invalid_plans_are_rejected(entries, shard: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan(4, shard, entries, 2)
    text = Plan(4, 8, (), 2).to_json().replace('"entries":[]', '"entries":[]')
    assert Plan.from_json(text).entries == ()


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a plan JSON"):
        Plan.from_json('{"world_size": 2}')
    good = _hand_plan().to_json().replace('"offset":8', '"offset":6')
    with pytest.raises(ValueError, match="'b'"):
        Plan.from_json(good)


def test_short_last_unit_example_from_the_issue() -> None:
    # A 25,700-element weight with 256-element blocks: the last block holds 100 elements.
    spec = TensorSpec("w", 25_700, 256, (100, 257))
    p = plan([spec], 4, align=4)
    cuts = [p.local_range("w", r) for r in range(4)]
    assert all(a % 256 == 0 for a, _ in cuts if (a, _) != (0, 0))
    assert p.shard_size == 6656  # the average 6425 rounded up to whole 256-blocks (26 of them)


def test_empty_group() -> None:
    p = plan([], 8)
    assert p.shard_size == 0 and p.entries == () and p.padding == 0
