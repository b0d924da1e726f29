"""Optimizer state that lives in the parameter's own placement, parameter naming, and the
checks every parameter group gets.

Elementwise state (momentum, Adam moments) is stored as a tensor of the parameter's placement
(a DTensor over the same mesh for a DTensor parameter), so checkpointing reshards it like the
parameter; the math itself runs on the local tensors, which never need communication.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from ragged_dtensor import from_local_run
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def zeros_like_param(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Zeros with the parameter's shape and placement (a DTensor for a DTensor parameter).

    Built from the local tensor with :func:`ragged_dtensor.from_local_run`, so no sharding
    propagation runs for custom placements and the state's local tensor is the zeros tensor
    itself (not a view of it).

    Args:
        param: The parameter.
        dtype: The state dtype (default: the parameter's).

    Returns:
        The zero state.
    """
    if not isinstance(param, DTensor):
        return torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
    zeros = torch.zeros_like(param.to_local(), dtype=dtype, memory_format=torch.contiguous_format)
    return from_local_run(zeros, param.device_mesh, param.placements, param.shape)


def named_params(param_groups: list[Mapping[str, Any]]) -> Iterator[tuple[Mapping[str, Any], str, torch.Tensor]]:
    """``(group, name, param)`` for every parameter; names from ``named_parameters()`` when the
    optimizer was built with them, else ``"group{g}.param{i}"``."""
    for g, group in enumerate(param_groups):
        for name, p in _named_group(group, g):
            yield group, name, p


def _named_group(group: Mapping[str, Any], g: int) -> Iterator[tuple[str, torch.Tensor]]:
    names = group.get("param_names")
    for i, p in enumerate(group["params"]):
        yield (names[i] if names else f"group{g}.param{i}"), p


def is_number(value: object) -> bool:
    """A real number or a one-element tensor (torch takes a tensor ``lr``): range checks compare
    only these, so a hyper-parameter of another type fails its check by name instead of raising
    a bare comparison ``TypeError``."""
    return isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def as_tuple(value: object) -> object:
    """``tuple(value)`` for an iterable hyper-parameter (betas, coefficients); anything else
    unchanged, so that its group check names it instead of ``tuple()`` raising a bare error."""
    return tuple(value) if isinstance(value, Iterable) else value


def is_sequence(value: object, length: int) -> bool:
    """``value`` is a sequence (or 1-D tensor) of ``length`` items: betas or coefficients."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 1 and len(value) == length
    return isinstance(value, Sequence) and len(value) == length


def dtype_name(dtype: object) -> object:
    """``torch.bfloat16`` -> ``"bfloat16"``; anything else unchanged (checked later)."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def named_dtype(value: object) -> torch.dtype | None:
    """The dtype a group holds by name (or, from an older state dict, as a ``torch.dtype``);
    ``None`` for anything that names no dtype."""
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    return dtype if isinstance(dtype, torch.dtype) else None


Check = tuple[str, bool, str]
"""``(hyper-parameter, holds, rule)``: one range check of a parameter group."""


def check_hyperparameters(optimizer: str, group: Mapping[str, Any], checks: Iterable[Check]) -> None:
    """Raise on the first failed check, naming the hyper-parameter, its rule and its value.

    Args:
        optimizer: The optimizer's name, for the message.
        group: The parameter group (or the constructor's defaults).
        checks: The group's checks.

    Raises:
        ValueError: For a hyper-parameter out of range.
    """
    for name, ok, rule in checks:
        if not ok:
            raise ValueError(f"{optimizer}: {name} {rule}, got {group[name]!r}")


class MatrixOptimizer(torch.optim.Optimizer):
    """A torch optimizer over 0-D to 3-D parameters whose groups are checked as they are added.

    Subclasses set :attr:`optimizer_name` and implement :meth:`group_checks` and
    :meth:`_step` (the step without the closure).
    """

    optimizer_name = "MatrixOptimizer"
    dtype_hyperparameters: tuple[str, ...] = ()
    """Hyper-parameters holding a dtype, kept in the param groups by name (``"bfloat16"``):
    torch's state-dict tooling (``get_optimizer_state_dict(full_state_dict=True)``, DCP)
    carries only plain values there."""
    _groups_by_param: dict[int, dict[str, Any]] | None = None

    def group_checks(self, group: Mapping[str, Any]) -> list[Check]:
        """The range checks of one parameter group.

        Args:
            group: The group, defaults filled in.

        Returns:
            Its checks.
        """
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyper-parameters and parameter ranks.

        Args:
            param_group: The group (``params`` plus any hyper-parameter overrides).

        Raises:
            ValueError: On a hyper-parameter out of range or a parameter of 4+ dimensions
                (the group is then not added).
        """
        self._groups_by_param = None
        param_group = {key: dtype_name(value) if key in self.dtype_hyperparameters else value
                       for key, value in param_group.items()}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_hyperparameters(self.optimizer_name, group, self.group_checks(group))
            for name, p in _named_group(group, len(self.param_groups) - 1):
                check_matrix_rank(p, name, self.optimizer_name)
        except ValueError:
            self.param_groups.pop()  # a rejected group must not stay in the optimizer
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, if given.

        Raises:
            ValueError: On every rank, naming the parameter, if the input of a whole-matrix
                computation is not finite (Muon: a Newton-Schulz input; Shampoo: a gradient
                block; for Muon see also ``sync_nonfinite_check``). The step is then not
                applied at all: every parameter and every state tensor is left as it was.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the optimizer (``load_state_dict`` replaces every group dict this way)."""
        super().__setstate__(state)
        self._groups_by_param = None

    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The group holding ``param``: one dict lookup, the index being rebuilt after the
        groups change (:meth:`add_param_group`, ``load_state_dict``)."""
        if self._groups_by_param is None:
            self._groups_by_param = {id(p): g for g in self.param_groups for p in g["params"]}
        return self._groups_by_param[id(param)]


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
