"""Inverse matrix roots of Shampoo's statistics, by symmetric eigendecomposition.

``A^{-1/p} = Q diag(lambda^{-1/p}) Q^T`` from ``eigh(A + epsilon I)``. Eigenvalues are clamped at
0 (round-off can make a positive semi-definite statistic's smallest ones slightly negative) and a
zero eigenvalue contributes 0 (pseudo-inverse), so a rank-deficient block never produces inf. A
failed decomposition (or a non-finite result) is retried in float64, which converges where
float32 does not on ill-conditioned statistics.
"""

from __future__ import annotations

import torch


def inverse_root(matrix: torch.Tensor, root: int, epsilon: float = 1e-12) -> torch.Tensor:
    """``(matrix + epsilon I)^(-1/root)`` for a symmetric positive semi-definite matrix.

    Args:
        matrix: A square symmetric matrix.
        root: The root ``p`` (Shampoo uses 4 for each side of a 2-D block).
        epsilon: Added to the diagonal before the decomposition.

    Returns:
        The inverse root, in ``matrix``'s dtype.

    Raises:
        torch.linalg.LinAlgError: If the float64 retry fails too.
    """
    try:
        result = _eigh_inverse_root(matrix, root, epsilon)
        if bool(torch.isfinite(result).all()):
            return result
    except torch.linalg.LinAlgError:
        if matrix.dtype == torch.float64:
            raise
    return _eigh_inverse_root(matrix.double(), root, epsilon).to(matrix.dtype)


def _eigh_inverse_root(matrix: torch.Tensor, root: int, epsilon: float) -> torch.Tensor:
    identity = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix + epsilon * identity)
    eigenvalues = eigenvalues.clamp(min=0)
    powered = torch.where(eigenvalues > 0, eigenvalues.pow(-1.0 / root), torch.zeros_like(eigenvalues))
    return (eigenvectors * powered) @ eigenvectors.mT
