"""Optimizer state that lives in the parameter's own placement, and parameter naming.

Elementwise state (momentum, Adam moments) is stored as a tensor of the parameter's placement
(a DTensor over the same mesh for a DTensor parameter), so checkpointing reshards it like the
parameter; the math itself runs on the local tensors, which never need communication.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def zeros_like_param(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Zeros with the parameter's shape and placement (a DTensor for a DTensor parameter).

    Built from the local tensor, so no sharding propagation runs for custom placements.

    Args:
        param: The parameter.
        dtype: The state dtype (default: the parameter's).

    Returns:
        The zero state.
    """
    if not isinstance(param, DTensor):
        return torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
    zeros = torch.zeros_like(param.to_local(), dtype=dtype, memory_format=torch.contiguous_format)
    return DTensor.from_local(
        zeros, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
        run_check=False,
    )


def named_params(param_groups: list[Mapping[str, Any]]) -> Iterator[tuple[Mapping[str, Any], str, torch.Tensor]]:
    """``(group, name, param)`` for every parameter; names from ``named_parameters()`` when the
    optimizer was built with them, else ``"group{g}.param{i}"``."""
    for g, group in enumerate(param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            yield group, (names[i] if names else f"group{g}.param{i}"), p


def check_matrix_rank(param: torch.Tensor, name: str, optimizer: str) -> None:
    """Reject parameters of four or more dimensions with an error naming them.

    Raises:
        ValueError: For a parameter with ``ndim >= 4``.
    """
    if param.ndim >= 4:
        raise ValueError(
            f"{optimizer}: parameter '{name}' has shape {tuple(param.shape)}; supported are 0-D and "
            "1-D (elementwise), 2-D matrices and 3-D stacks [E, rows, cols] of E matrices; reshape "
            "it (e.g. a convolution to [out, in * k * k])"
        )
