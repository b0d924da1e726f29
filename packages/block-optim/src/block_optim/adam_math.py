"""Elementwise Adam in fp32 on local tensors: Muon's internal AdamW and Shampoo's grafting.

Elementwise math needs no whole matrix, so it runs on each rank's local run of a parameter in
any placement. The formulas are ``torch.optim.AdamW``'s single-tensor path, so a parameter
handled here matches it to rounding.
"""

from __future__ import annotations

import math

import torch


def adam_moments(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    betas: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments after one step, out of place (the old ones are left as they are, so a
    step that fails later can be abandoned).

    Args:
        grad: The gradient.
        exp_avg: First moment before the step.
        exp_avg_sq: Second moment before the step.
        betas: ``(beta1, beta2)``.

    Returns:
        ``(exp_avg, exp_avg_sq)`` after the step (new tensors).
    """
    beta1, beta2 = betas
    return exp_avg.lerp(grad, 1 - beta1), exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_direction(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    betas: tuple[float, float],
    eps: float,
) -> tuple[torch.Tensor, float]:
    """Adam's un-scaled direction from the moments of step ``step``.

    Args:
        exp_avg: First moment after the step.
        exp_avg_sq: Second moment after the step.
        step: The step number, from 1 (bias correction).
        betas: ``(beta1, beta2)``.
        eps: Added to the bias-corrected square root.

    Returns:
        ``(direction, scale)``: the parameter moves by ``-lr * scale * direction``, where
        ``direction = exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)`` and
        ``scale = 1 / (1 - beta1^t)`` (kept apart, as torch does, for bit-equal results).
    """
    beta1, beta2 = betas
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    return exp_avg / denom, 1 / (1 - beta1**step)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on a local tensor, in place (decoupled weight decay first).

    Args:
        param: The parameter's local tensor, updated in place.
        grad: Its gradient.
        exp_avg: First moment, updated in place.
        exp_avg_sq: Second moment, updated in place.
        step: The step number, from 1.
        lr: Learning rate.
        betas: ``(beta1, beta2)``.
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay.
    """
    param.mul_(1 - lr * weight_decay)
    new_avg, new_avg_sq = adam_moments(grad, exp_avg, exp_avg_sq, betas=betas)
    exp_avg.copy_(new_avg)
    exp_avg_sq.copy_(new_avg_sq)
    direction, scale = adam_direction(exp_avg, exp_avg_sq, step=step, betas=betas, eps=eps)
    param.add_(direction, alpha=-lr * scale)
