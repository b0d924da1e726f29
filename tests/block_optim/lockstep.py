"""Single-device helper: step an optimizer and its reference on the same random gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def step_in_lockstep(
    opt: torch.optim.Optimizer,
    ref: torch.optim.Optimizer,
    ours: Sequence[torch.Tensor],
    theirs: Sequence[torch.Tensor],
    steps: int,
    generator: torch.Generator | None = None,
) -> None:
    """``steps`` times: draw one gradient per parameter, give it to both sides, step both."""
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
