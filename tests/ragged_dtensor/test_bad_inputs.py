"""Bad-input table for ragged_dtensor's public entry points (issue 10): 24 invalid inputs.

Each case runs on a world-size-1 gloo rank (the entry points need a mesh) and asserts the
exception type and a message naming the argument or tensor at fault. Not repeated here:
local_units vs mesh size, units not dividing the prefix rows and too few dims
(test_placement.py / test_redistribute.py), from_element_counts summing wrong,
DTensor.from_local run checks with consensus (test_from_local_checks.py), and
raise_on_any_rank's consensus (test_consensus.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate

from ragged_dtensor import (
    RaggedShard,
    distribute_tensor,
    from_local_run,
    from_local_run_like,
    local_shaped,
    raise_on_any_rank,
    redistribute_many,
    set_roll_call_timeout,
)
from tests.bad_inputs import assert_names_fault, raised_by
from tests.harness import device_mesh

ROWS = RaggedShard((0,), [1])


def _full() -> torch.Tensor:
    return torch.arange(12.0).view(4, 3)


def _ragged(mesh: Any) -> Any:
    return distribute_tensor(_full(), mesh, [ROWS])


CASES: dict[str, tuple[Callable[[Any], object], type[BaseException], str]] = {
    "raggedshard-dims-empty": (lambda m: RaggedShard((), [1]), ValueError, r"RaggedShard dims must be a non-empty"),
    "raggedshard-dims-not-prefix": (lambda m: RaggedShard((1, 0), [1]), ValueError, r"dims .*got \(1, 0\)"),
    "raggedshard-local_units-empty": (lambda m: RaggedShard((0,), []), ValueError, r"local_units need at least one"),
    "raggedshard-local_units-all-zero": (lambda m: RaggedShard((0,), [0, 0]), ValueError, r"local_units need at least"),
    "raggedshard-local_units-negative": (lambda m: RaggedShard((0,), [-1, 2]), ValueError, r"local_units must be non-n"),
    "raggedshard-local_units-float": (lambda m: RaggedShard((0,), [1.5]), ValueError, r"local_units must be integers"),
    "from_element_counts-negative": (lambda m: RaggedShard.from_element_counts((4, 3), [-3, 15]), ValueError,
                                     r"element counts \(-3, 15\) must be non-negative"),
    "distribute_tensor-device_mesh-none": (lambda m: distribute_tensor(_full(), None, [ROWS]), ValueError,
                                           r"needs a device_mesh"),
    "distribute_tensor-placements-too-many": (lambda m: distribute_tensor(_full(), m, [ROWS, Replicate()]),
                                              ValueError, r"2 placements for a 1-D mesh"),
    "distribute_tensor-tensor-0d": (lambda m: distribute_tensor(torch.tensor(1.0), m, [ROWS]), ValueError,
                                    r"needs a tensor of at least 1 dims, got shape \(\)"),
    "distribute_tensor-tensor-list": (lambda m: distribute_tensor([1.0, 2.0], m, [ROWS]), TypeError,
                                      r"tensor must be a torch.Tensor, got list"),
    "from_local_run-local-2d": (lambda m: from_local_run(torch.ones(4, 3), m, [ROWS], (4, 3)), ValueError,
                                r"1-D run of 12 elements, but its local tensor has shape \(4, 3\)"),
    "from_local_run-local-wrong-size": (lambda m: from_local_run(torch.ones(11), m, [ROWS], (4, 3)), ValueError,
                                        r"run of 12 elements, but its local tensor has shape \(11,\)"),
    "from_local_run-local-non-contiguous": (lambda m: from_local_run(torch.ones(24)[::2], m, [ROWS], (4, 3)),
                                            ValueError, r"local tensor has shape \(12,\) and"),
    "from_local_run-placements-too-many": (lambda m: from_local_run(torch.ones(12), m, [ROWS, Replicate()], (4, 3)),
                                           ValueError, r"from_local_run: 2 placements for a 1-D mesh"),
    "from_local_run-local-list": (lambda m: from_local_run([1.0] * 12, m, [ROWS], (4, 3)), TypeError,
                                  r"from_local_run: local must be a torch.Tensor, got list"),
    "from_local_run_like-local-wrong-size": (lambda m: from_local_run_like(torch.ones(11), _ragged(m)), ValueError,
                                             r"local of shape \(11,\) cannot be placed like a DTensor whose local tensor has shape \(12,\)"),
    "set_roll_call_timeout-negative": (lambda m: set_roll_call_timeout(-1), ValueError,
                                       r"set_roll_call_timeout: seconds must be >= 0, got -1"),
    "set_roll_call_timeout-nan": (lambda m: set_roll_call_timeout(float("nan")), ValueError,
                                  r"set_roll_call_timeout: seconds must be >= 0, got nan"),
    "set_roll_call_timeout-str": (lambda m: set_roll_call_timeout("5"), TypeError,
                                  r"set_roll_call_timeout: seconds must be a number, got str '5'"),
    "local_shaped-dtensor-plain-tensor": (lambda m: local_shaped(torch.ones(3)), TypeError,
                                          r"dtensor must be a DTensor, got Tensor"),
    "redistribute_many-lengths-differ": (lambda m: redistribute_many([_ragged(m)], [[Replicate()], [Replicate()]]),
                                         ValueError, r"got 1 dtensors but 2 placements"),
    "redistribute_many-placements-two": (lambda m: redistribute_many([_ragged(m)], [[Replicate(), Replicate()]]),
                                         ValueError, r"tensor 0 must be on the first tensor's 1-D mesh"),
    "redistribute_many-tensor-plain": (lambda m: redistribute_many([_ragged(m), _full()], [[Replicate()]] * 2),
                                       TypeError, r"tensor 1 must be a DTensor, got Tensor"),
    "raise_on_any_rank-error-str": (lambda m: raise_on_any_rank("oops"), TypeError,
                                    r"raise_on_any_rank: error must be an exception or None, got str 'oops'"),
}


def run_case(case_id: str) -> tuple[str, str] | None:
    """Run one case on this rank; the raised exception's type name and message, or None."""
    return raised_by(CASES[case_id][0], device_mesh(1))


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input_names_the_argument(ranks: Any, case_id: str) -> None:
    _, error, message = CASES[case_id]
    (raised,) = ranks.run(1, run_case, case_id)
    assert_names_fault(case_id, raised, error, message)
