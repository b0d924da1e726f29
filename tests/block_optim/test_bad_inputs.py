"""Bad-input table for block_optim's public entry points (issue 10): 25 invalid inputs.

Single-process cases asserting the exception type and a message naming the hyper-parameter or
parameter at fault. Not repeated here: out-of-range hyper-parameters of every optimizer and 4-D
parameters by name (test_group_checks.py, test_adamw8bit.py), sparse gradients
(test_adamw8bit.py), and a NaN Newton-Schulz / Shampoo input raising on every rank at world
sizes 1 and 3 with nothing changed (test_failed_step.py, test_muon.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from block_optim import AdamW8bit, Muon, Shampoo


def _p(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(*shape))


def _step_named(optimizer: type, fill: float, **kwargs: object) -> None:
    """One step of a Linear(4, 4) whose weight gradient is ``fill`` everywhere."""
    layer = torch.nn.Linear(4, 4)
    layer.weight.grad = torch.full((4, 4), fill)
    layer.bias.grad = torch.zeros(4)
    optimizer(layer.named_parameters(), **kwargs).step()


def _step_stack(optimizer: type, fill: float, **kwargs: object) -> None:
    """One step of one (2, 3, 3) stack of matrices, the second matrix's gradient ``fill``."""
    p = _p(2, 3, 3)
    p.grad = torch.zeros(2, 3, 3)
    p.grad[1, 0, 0] = fill
    optimizer([p], **kwargs).step()


SHAMPOO_NOW = {"start_preconditioning_step": 1, "precondition_frequency": 1}

CASES: list[tuple[str, Callable[[], object], type[BaseException], str]] = [
    ("muon-lr-str", lambda: Muon([_p(3, 3)], lr="0.1"), ValueError, r"Muon: lr must be >= 0, got '0.1'"),
    ("muon-lr-nan", lambda: Muon([_p(3, 3)], lr=math.nan), ValueError, r"Muon: lr must be >= 0, got nan"),
    ("muon-momentum-none", lambda: Muon([_p(3, 3)], momentum=None), ValueError, r"Muon: momentum must be in"),
    ("muon-weight_decay-str", lambda: Muon([_p(3, 3)], weight_decay="0"), ValueError, r"Muon: weight_decay"),
    ("muon-ns_steps-float", lambda: Muon([_p(3, 3)], ns_steps=2.5), ValueError, r"Muon: ns_steps must be an int"),
    ("muon-scaling-none", lambda: Muon([_p(3, 3)], scaling=None), ValueError, r"Muon: scaling must be one of"),
    ("muon-adamw_betas-str", lambda: Muon([_p(3, 3)], adamw_betas=("a", "b")), ValueError, r"Muon: adamw_betas"),
    ("muon-params-empty", lambda: Muon([]), ValueError, r"empty parameter list"),
    ("muon-params-tensor", lambda: Muon(_p(3, 3)), TypeError, r"params argument given to the optimizer"),
    ("muon-param-4d-second-group", lambda: Muon([{"params": [_p(3, 3)]}, {"params": [_p(1, 1, 2, 2)]}]),
     ValueError, r"Muon: parameter 'group1.param0' has shape \(1, 1, 2, 2\)"),
    ("muon-grad-inf-newton-schulz", lambda: _step_named(Muon, math.inf, ns_dtype=torch.float32), ValueError,
     r"non-finite values in the Newton-Schulz input of parameter 'weight'"),
    ("muon-grad-nan-3d-stack", lambda: _step_stack(Muon, math.nan, ns_dtype=torch.float32), ValueError,
     r"Newton-Schulz input of parameter 'group0.param0' \(matrix 1, 3x3"),
    ("shampoo-lr-str", lambda: Shampoo([_p(3, 3)], lr="x"), ValueError, r"Shampoo: lr must be >= 0, got 'x'"),
    ("shampoo-betas-none", lambda: Shampoo([_p(3, 3)], betas=(0.9, None)), ValueError, r"Shampoo: betas must be"),
    ("shampoo-epsilon-nan", lambda: Shampoo([_p(3, 3)], epsilon=math.nan), ValueError, r"Shampoo: epsilon"),
    ("shampoo-param-4d", lambda: Shampoo([_p(1, 2, 3, 4)]), ValueError, r"Shampoo: parameter 'group0.param0' has"),
    ("shampoo-grad-nan", lambda: _step_named(Shampoo, math.nan, **SHAMPOO_NOW), ValueError,
     r"non-finite values in the gradient of parameter 'weight'"),
    ("shampoo-grad-inf-3d-stack", lambda: _step_stack(Shampoo, math.inf, **SHAMPOO_NOW), ValueError,
     r"gradient of parameter 'group0.param0' \(matrix 1, 3x3"),
    ("muon-adamw_betas-scalar", lambda: Muon([_p(3, 3)], adamw_betas=0.9), ValueError,
     r"Muon: adamw_betas must be two floats in \[0, 1\), got 0.9"),
    ("muon-ns_coefficients-scalar", lambda: Muon([_p(3, 3)], ns_coefficients=3.0), ValueError,
     r"Muon: ns_coefficients must be three floats"),
    ("shampoo-betas-scalar", lambda: Shampoo([_p(3, 3)], betas=0.9), ValueError, r"Shampoo: betas must be two"),
    ("adamw8bit-betas-scalar", lambda: AdamW8bit([_p(3, 3)], betas=0.9), ValueError, r"AdamW8bit: betas must be"),
    ("adamw8bit-betas-str", lambda: AdamW8bit([_p(3, 3)], betas=("a", "b")), ValueError, r"AdamW8bit: betas must"),
    ("adamw8bit-lr-str", lambda: AdamW8bit([_p(3, 3)], lr="x"), ValueError, r"AdamW8bit: lr must be a float"),
    ("adamw8bit-betas-one", lambda: AdamW8bit([_p(3, 3)], betas=(0.9,)), ValueError, r"AdamW8bit: betas must be"),
]


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(call: Callable[[], object], error: type[BaseException], message: str) -> None:
    with pytest.raises(error, match=message):
        call()
