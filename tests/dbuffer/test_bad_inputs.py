"""Bad-input table for dbuffer's public entry points (issue 10): 22 invalid inputs.

Each case runs on a world-size-1 gloo rank (construction is collective) and asserts the
exception type and a message naming the argument or tensor at fault. Not repeated here:
unsupported dtype, plan for another world size, unknown requires_grad names, fingerprint
mismatch across ranks, from_tensors with a missing tensor, local_view of an unknown name,
reduce_scatter op 'max', fold_grad of a wrong shape, freed-buffer access and frozen tensors
(test_buffer.py, test_checks.py, test_fold_grad.py and the other tests/dbuffer files).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from layout_planner import TensorSpec, plan

from dbuffer import DBuffer

from tests.bad_inputs import assert_names_fault, raised_by

PLAN = plan([TensorSpec("a", 12, 3, (4, 3)), TensorSpec("b", 4, 1, (4,))], 1)


def _built() -> DBuffer:
    return DBuffer.from_tensors({"a": torch.ones(4, 3), "b": torch.ones(4)}, PLAN)


def _view(method: str) -> Callable[[], object]:
    return lambda: getattr(_built(), method)("zz")


CASES: dict[str, tuple[Callable[[], object], type[BaseException], str]] = {
    "init-plan-dict": (lambda: DBuffer({"a": 1}), TypeError, r"plan must be a layout_planner.Plan, got dict"),
    "init-plan-none": (lambda: DBuffer(None), TypeError, r"plan must be a layout_planner.Plan, got NoneType"),
    "init-group-str": (lambda: DBuffer(PLAN, "world"), TypeError, r"group must be None, a ProcessGroup or a Device"),
    "init-device-unknown": (lambda: DBuffer(PLAN, device="nodevice"), RuntimeError, r"device string: nodevice"),
    "init-dtype-str": (lambda: DBuffer(PLAN, dtype="float32"), TypeError, r"dtype: dtype float32 is not supported"),
    "init-requires_grad-str": (lambda: DBuffer(PLAN, requires_grad="a"), TypeError,
                               r"requires_grad must be None or a collection of tensor names \(str\), got str 'a'"),
    "init-requires_grad-int": (lambda: DBuffer(PLAN, requires_grad=3), TypeError,
                               r"requires_grad must be None or a collection of tensor names \(str\), got int 3"),
    "init-reduce_dtype-int8": (lambda: DBuffer(PLAN, reduce_dtype=torch.int8), TypeError,
                               r"reduce_dtype: dtype torch.int8 is not supported"),
    "from_tensors-plan-dict": (lambda: DBuffer.from_tensors({}, {"a": 1}), TypeError, r"plan must be a layout_pl"),
    "from_tensors-named_full_tensors-list": (lambda: DBuffer.from_tensors([torch.ones(4, 3), torch.ones(4)], PLAN),
                                             TypeError, r"named_full_tensors must be a mapping"),
    "from_tensors-tensor-list": (lambda: DBuffer.from_tensors({"a": [1.0] * 12, "b": torch.ones(4)}, PLAN),
                                 TypeError, r"tensor 'a': expected a torch.Tensor, got list"),
    "from_tensors-tensor-transposed": (lambda: DBuffer.from_tensors({"a": torch.ones(3, 4), "b": torch.ones(4)}, PLAN),
                                       ValueError, r"tensor 'a': shape \(3, 4\) does not match the plan"),
    "from_tensors-tensor-extra": (lambda: DBuffer.from_tensors(
        {"a": torch.ones(4, 3), "b": torch.ones(4), "c": torch.ones(1)}, PLAN), ValueError, r"unexpected \['c'\]"),
    "sharded_param-unknown": (_view("sharded_param"), KeyError, r"tensor 'zz' is not in this DBuffer"),
    "unsharded_view-unknown": (_view("unsharded_view"), KeyError, r"tensor 'zz' is not in this DBuffer"),
    "grad_view-unknown": (_view("grad_view"), KeyError, r"tensor 'zz' is not in this DBuffer"),
    "sharded_grad_view-unknown": (_view("sharded_grad_view"), KeyError, r"tensor 'zz' is not in this DBuffer"),
    "sharded_grad-unknown": (_view("sharded_grad"), KeyError, r"tensor 'zz' is not in this DBuffer"),
    "fold_grad-name-unknown": (lambda: _built().fold_grad("zz", torch.ones(4)), KeyError, r"tensor 'zz' is not in"),
    "fold_grad-grad-list": (lambda: _built().fold_grad("b", [1.0] * 4), TypeError,
                            r"fold_grad\('b'\): expected the unsharded gradient as a plain tensor, got a list"),
    "reduce_scatter-op-mean": (lambda: _built().reduce_scatter("mean"), ValueError, r"op must be 'avg' or 'sum'"),
    "reduce_scatter-op-ReduceOp": (lambda: _built().reduce_scatter(dist.ReduceOp.SUM), ValueError,
                                   r"op must be 'avg' or 'sum', got <RedOpType.SUM"),
}


def run_case(case_id: str) -> tuple[str, str] | None:
    """Run one case on this rank; the raised exception's type name and message, or None."""
    return raised_by(CASES[case_id][0])


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input_names_the_argument(ranks: Any, case_id: str) -> None:
    _, error, message = CASES[case_id]
    (raised,) = ranks.run(1, run_case, case_id)
    assert_names_fault(case_id, raised, error, message)
