"""State changes of one optimizer step, held back until the step is known to succeed.

Muon and Shampoo learn that a Newton-Schulz input or a gradient is not finite only once the
owners have run (sharded: once every owner's status has come back in the return all-to-all).
A step that raises must leave every parameter and every state tensor as it was, on every rank,
or the next finite step would build on a half-applied one (NaN momentum, moments or
statistics). So a step computes its new state out of place, records it here, and writes it
with :meth:`PendingStep.commit` only after the whole-matrix computation returned.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch


class PendingStep:
    """The state writes of one step, applied together by :meth:`commit`.

    Args:
        state: The optimizer's ``state`` mapping (parameter -> state dict).
    """

    def __init__(self, state: MutableMapping[torch.Tensor, dict[str, Any]]) -> None:
        self._state = state
        self._created: dict[torch.Tensor, dict[str, Any]] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._entries: list[tuple[dict[str, Any], str, Any]] = []

    def state_of(self, param: torch.Tensor, create: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The parameter's state; a state created now (by ``create``) joins the optimizer only
        on :meth:`commit`.

        Args:
            param: The parameter.
            create: Builds its initial state.

        Returns:
            The state dict (read it; record changes with :meth:`copy` and :meth:`put`).
        """
        state = self._state.get(param)
        if state:
            return state
        if param not in self._created:
            self._created[param] = create()
        return self._created[param]

    def copy(self, target: torch.Tensor, value: torch.Tensor) -> None:
        """Record ``target.copy_(value)``."""
        self._copies.append((target, value))

    def put(self, mapping: dict[str, Any], key: str, value: Any) -> None:
        """Record ``mapping[key] = value``."""
        self._entries.append((mapping, key, value))

    def commit(self) -> None:
        """Apply every recorded change."""
        self._state.update(self._created)
        for target, value in self._copies:
            target.copy_(value)
        for mapping, key, value in self._entries:
            mapping[key] = value
