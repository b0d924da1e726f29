"""Parameter-group checks shared by Muon and Shampoo (``block_optim.param_state.MatrixOptimizer``)."""

from __future__ import annotations

import pytest
import torch

from block_optim import Muon, Shampoo

BAD = {
    Muon: [({"lr": -1.0}, "lr"), ({"momentum": 1.0}, "momentum"), ({"weight_decay": -0.1}, "weight_decay"),
           ({"ns_steps": 0}, "ns_steps"), ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"),
           ({"scaling": "rms"}, "scaling"), ({"ns_dtype": torch.int32}, "ns_dtype"),
           ({"adamw_betas": (0.9, 1.0)}, "adamw_betas"), ({"eps": 0.0}, "eps")],
    Shampoo: [({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"),
              ({"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
              ({"precondition_frequency": 0}, "precondition_frequency"), ({"grafting": "rmsprop"}, "grafting"),
              ({"start_preconditioning_step": 0}, "start_preconditioning_step"), ({"epsilon": -1.0}, "epsilon"),
              ({"preconditioner_dtype": torch.float16}, "preconditioner_dtype")],
}


@pytest.mark.parametrize(("optimizer", "kwargs", "match"),
                         [(opt, kwargs, match) for opt, cases in BAD.items() for kwargs, match in cases])
def test_rejects_bad_hyperparameters(optimizer: type, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        optimizer([torch.nn.Parameter(torch.randn(3, 3))], **kwargs)


@pytest.mark.parametrize("optimizer", [Muon, Shampoo])
def test_rejects_4d_parameters_by_name(optimizer: type) -> None:
    conv = torch.nn.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match="'weight' has shape"):
        optimizer(conv.named_parameters())


@pytest.mark.parametrize("optimizer", [Muon, Shampoo])
def test_added_group_is_checked_with_its_index_in_names(optimizer: type) -> None:
    opt = optimizer([torch.nn.Parameter(torch.randn(3, 3))])
    with pytest.raises(ValueError, match=f"{optimizer.__name__}: lr must be >= 0, got -1.0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "lr": -1.0})
    with pytest.raises(ValueError, match=r"'group1.param0' has shape \(1, 1, 1, 1\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(1, 1, 1, 1))]})
