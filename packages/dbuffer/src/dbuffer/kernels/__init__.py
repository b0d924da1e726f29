"""Fused whole-buffer operations: one launch per flat buffer instead of one per tensor.

Triton kernels on CUDA tensors, plain torch on CPU (see :mod:`dbuffer.kernels.dispatch`).
"""

from dbuffer.kernels.dispatch import (
    Backend,
    add_,
    copy_cast_,
    scale_,
    squared_norm,
    triton_available,
    zero_,
)

__all__ = ["Backend", "add_", "copy_cast_", "scale_", "squared_norm", "triton_available", "zero_"]
