"""Plain-torch implementations of the fused whole-buffer operations (the CPU path).

Each is one torch op over the whole flat buffer (two for an upcasting scaled copy), computing
in fp32 or wider (float64 for float64 buffers) with one rounding into the destination dtype, so they match the Triton
kernels bit for bit on fp32 and to the last bit's rounding mode on bf16/fp16.
"""

from __future__ import annotations

import torch


def zero_(dst: torch.Tensor) -> None:
    """``dst[:] = 0``."""
    dst.zero_()


def scale_(dst: torch.Tensor, alpha: float) -> None:
    """``dst[:] *= alpha``."""
    dst.mul_(alpha)


def copy_cast_(dst: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
    """``dst[:] = alpha * src`` in ``dst``'s dtype.

    When ``dst`` is at least as precise as ``src`` the (exact) cast comes first and the scale
    is computed in ``dst``'s opmath type with one rounding; otherwise one ``mul`` computes in
    ``src``'s opmath type and rounds into ``dst`` (between bf16 and fp16 that rounds twice,
    through the source dtype; DBuffer never pairs those two).
    """
    if alpha == 1.0:
        dst.copy_(src)
    elif torch.finfo(dst.dtype).eps <= torch.finfo(src.dtype).eps:
        dst.copy_(src)
        dst.mul_(alpha)
    else:
        torch.mul(src, alpha, out=dst)


def add_(dst: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
    """``dst[:] += alpha * src`` in fp32 (float64 for a float64 ``dst``), rounded once into
    ``dst``.

    torch's ``add_(alpha=)`` rounds ``alpha`` to a 16-bit ``dst``'s dtype, so a 16-bit
    destination with ``alpha != 1`` takes an fp32 temporary for the scaled source instead.
    """
    if alpha == 1.0 or dst.dtype in (torch.float32, torch.float64):
        dst.add_(src, alpha=alpha)
    else:
        dst.add_(src.to(torch.float32, copy=True).mul_(alpha))


def squared_norm(src: torch.Tensor) -> torch.Tensor:
    """``sum(src ** 2)`` accumulated in fp32 (float64 for float64), as a 0-d tensor."""
    dtype = torch.float64 if src.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(src, 2, dtype=dtype).square()
