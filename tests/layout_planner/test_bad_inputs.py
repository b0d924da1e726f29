"""Bad-input table for layout_planner's public entry points (issue 10): 25 invalid inputs
(24 table cases plus one CLI case).

Each case calls one entry point with one bad argument and asserts the exception type and a
message naming the argument or tensor at fault. Cases already covered elsewhere are not
repeated: TensorSpec fields and plan() world_size/align/duplicates (test_spec_and_plan.py),
Plan construction rules and Plan.from_json (test_spec_and_plan.py), plan_buckets
max_buckets/bucket_cost (test_buckets.py), Link bandwidth/latency, predict_step shard_group and
unknown model (test_simulate.py), CLI unknown model / world size 0 / bad unit
(test_catalog_report_cli.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from layout_planner import Cluster, Link, Plan, TensorSpec, assign_owners, plan, plan_buckets, predict_step
from layout_planner.cli import main

A = TensorSpec("a", 8, 1)

CASES: list[tuple[str, Callable[[], object], type[BaseException], str]] = [
    ("plan-world_size-float", lambda: plan([A], 2.0), ValueError, r"world_size must be a positive int, got 2\.0"),
    ("plan-world_size-bool", lambda: plan([A], True), ValueError, r"world_size must be a positive int, got True"),
    ("plan-specs-dict", lambda: plan([{"name": "a"}], 2), TypeError, r"expected TensorSpec, got dict"),
    ("tensorspec-numel-str", lambda: TensorSpec("a", "8", 1), ValueError, r"tensor 'a': numel must be a positive int"),
    ("tensorspec-shape-zero-size", lambda: TensorSpec("a", 8, 1, (8, 0)), ValueError, r"tensor 'a': shape"),
    ("plan_buckets-world_size-zero", lambda: plan_buckets([A], 0), ValueError, r"world_size must be a positive int"),
    ("plan_buckets-align-negative", lambda: plan_buckets([A], 2, align=-1), ValueError, r"align must be a positive int"),
    ("plan_buckets-specs-duplicate", lambda: plan_buckets([A, A], 2), ValueError, r"duplicate tensor name 'a'"),
    ("assign_owners-world_size-zero", lambda: assign_owners([1.0], 0), ValueError, r"world_size must be a positive int"),
    ("assign_owners-cost-nan", lambda: assign_owners([1.0, math.nan], 2), ValueError, r"cost of item 1 must be finite"),
    ("assign_owners-cost-negative", lambda: assign_owners([-1.0], 2), ValueError, r"cost of item 0 must be finite"),
    ("assign_owners-cost-str", lambda: assign_owners(["ab"], 2), ValueError, r"cost of item 0 must be finite.*'ab'"),
    ("assign_owners-fixed-index", lambda: assign_owners([1.0], 2, {5: 0}), ValueError, r"fixed item index 5"),
    ("assign_owners-fixed-rank", lambda: assign_owners([1.0], 2, {0: 7}), ValueError, r"fixed rank 7 of item 0"),
    ("plan-ctor-world_size-zero", lambda: Plan(0, 4, ()), ValueError, r"plan world_size must be an int >= 1"),
    ("plan-ctor-entries-type", lambda: Plan(2, 4, ("a",)), ValueError, r"plan entries must be PlanEntry, got str"),
    ("plan-local_range-rank", lambda: plan([A], 2).local_range("a", 2), ValueError, r"rank 2 is out of range"),
    ("link-bandwidth-nan", lambda: Link(math.nan, 0.0), ValueError, r"link bandwidth must be a finite number"),
    ("cluster-gpus_per_node-zero", lambda: Cluster(gpus_per_node=0), ValueError, r"gpus_per_node must be a positive"),
    ("cluster-intra-type", lambda: Cluster(intra=3), ValueError, r"cluster intra must be a Link"),
    ("predict_step-world_size-zero", lambda: predict_step("llama3-8b", 0), ValueError, r"world_size must be a positive"),
    ("predict_step-cluster-type", lambda: predict_step("llama3-8b", 8, cluster="x"), TypeError, r"cluster must be"),
    ("predict_step-param_bytes-zero", lambda: predict_step("llama3-8b", 8, param_bytes=0), ValueError, r"param_bytes"),
    ("predict_step-max_buckets-zero", lambda: predict_step("llama3-8b", 8, max_buckets=0), ValueError, r"max_buckets"),
]


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(call: Callable[[], object], error: type[BaseException], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_cli_bad_align_is_a_usage_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI turns a bad --align into argparse's exit status 2 with the argument named."""
    with pytest.raises(SystemExit) as info:
        main(["report", "--world-size", "8", "--align", "0"])
    assert info.value.code == 2
    assert "align must be a positive int, got 0" in capsys.readouterr().err
