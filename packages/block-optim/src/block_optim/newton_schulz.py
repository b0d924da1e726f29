"""The Newton-Schulz quintic iteration that Muon uses to orthogonalize an update.

Pure functions of a matrix, kept apart from any optimizer state or communication so that the
math can be checked on one screen and tested alone. The iteration acts on each singular value
separately: the output's singular values are :func:`quintic_map` applied to the input's singular
values divided by its Frobenius norm (plus ``eps``); the singular vectors are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's coefficients ``(a, b, c)`` of ``x -> a x + b x^3 + c x^5``: maximal slope at
zero, so five steps lift small singular values to roughly 0.7-1.2 (not exactly 1)."""

DEFAULT_STEPS = 5
DEFAULT_EPS = 1e-7


def newton_schulz(
    matrix: torch.Tensor,
    *,
    steps: int = DEFAULT_STEPS,
    coefficients: Sequence[float] = QUINTIC,
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalize one matrix with the quintic Newton-Schulz iteration.

    The matrix is cast to ``dtype``, transposed when tall (so the Gram matrix is the small side),
    divided by its Frobenius norm plus ``eps`` (which bounds the spectral norm by 1), iterated
    ``X <- a X + (b A + c A A) X`` with ``A = X X^T``, transposed back and cast to the input dtype.

    Args:
        matrix: A 2-D tensor.
        steps: Number of iterations.
        coefficients: The quintic's ``(a, b, c)``.
        eps: Added to the Frobenius norm before dividing.
        dtype: The dtype the iteration runs in (bf16 as in Muon's reference; fp32 for exactness).

    Returns:
        A tensor of ``matrix``'s shape and dtype.
    """
    if matrix.ndim != 2:
        raise ValueError(f"newton_schulz takes a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    if tall:
        x = x.mT
    return x.to(matrix.dtype)


def quintic_map(
    values: torch.Tensor,
    *,
    steps: int = DEFAULT_STEPS,
    coefficients: Sequence[float] = QUINTIC,
) -> torch.Tensor:
    """Apply the scalar iteration ``s <- a s + b s^3 + c s^5`` ``steps`` times, elementwise.

    This is what :func:`newton_schulz` does to each normalised singular value.

    Args:
        values: Any tensor of (normalised) singular values.
        steps: Number of iterations.
        coefficients: The quintic's ``(a, b, c)``.

    Returns:
        A tensor like ``values``.
    """
    a, b, c = coefficients
    s = values
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def newton_schulz_flops(rows: int, cols: int, steps: int = DEFAULT_STEPS) -> float:
    """Multiply-add count (times two) of :func:`newton_schulz` on a ``rows x cols`` matrix.

    Per step with ``m = min(rows, cols)``, ``n = max(rows, cols)``: the Gram matrix ``2 m^2 n``,
    its square ``2 m^3`` and the product with ``X`` ``2 m^2 n``. Owners are balanced by this cost.

    Args:
        rows: Matrix rows.
        cols: Matrix columns.
        steps: Number of iterations.

    Returns:
        The floating-point operation count.
    """
    m, n = min(rows, cols), max(rows, cols)
    return float(steps * (4 * m * m * n + 2 * m**3))
