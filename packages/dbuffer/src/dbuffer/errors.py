"""DBuffer's checks and error types.

Local checks (a dtype, a plan that does not match the group) return or raise errors naming the
argument at fault; :func:`check_consistent` then makes every rank raise, with one small
all-reduce (:func:`ragged_dtensor.raise_on_any_rank`), if any rank found a problem or if the
ranks disagree on the buffer's plan, so no rank is left waiting in the buffer's first
collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from ragged_dtensor import raise_on_any_rank

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16,
                                              torch.float64, torch.float8_e4m3fn,
                                              torch.float8_e5m2)
"""Every dtype a DBuffer holds: the floating-point dtypes FSDP2 accepts for parameters."""

BYTE_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Dtypes moved as raw bytes (gloo has no float8 type) and held without arithmetic: a DBuffer
holding them has no gradients (frozen tensors, as FSDP2 takes float8 weights)."""


class FreedBufferError(RuntimeError):
    """A view of a buffer was requested (or the buffer used) while its storage is freed."""


def check_dtype(dtype: torch.dtype, arg: str) -> None:
    """Raise ``TypeError`` unless ``dtype`` is one DBuffer and its kernels support.

    Args:
        dtype: the dtype to check.
        arg: the name of the argument or tensor, for the message.

    Raises:
        TypeError: for any dtype outside :data:`SUPPORTED_DTYPES`.
    """
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{arg}: dtype {dtype} is not supported (supported: {names})")


def check_gradient_dtype(dtype: torch.dtype, arg: str) -> None:
    """Raise ``TypeError`` when gradients would be computed or reduced in ``dtype``.

    Args:
        dtype: a dtype of a buffer with trainable tensors.
        arg: the name of the argument, for the message.

    Raises:
        TypeError: for a dtype of :data:`BYTE_DTYPES` (no gradient arithmetic in float8).
    """
    if dtype in BYTE_DTYPES:
        raise TypeError(f"{arg}: dtype {dtype} holds no gradients (float8 tensors are held as "
                        "bytes): make them frozen (requires_grad=False / requires_grad=())")


def check_consistent(error: BaseException | None, fingerprint: str,
                     groups: Sequence[dist.ProcessGroup]) -> None:
    """Raise on every rank if any rank passed an error or the fingerprints differ.

    One :func:`ragged_dtensor.raise_on_any_rank` per group (one on a 1-D group, one per
    dimension of a 2-D mesh), each a single small all-reduce on the happy path that carries
    both the error flag and the fingerprint. A local error wins over a fingerprint difference
    (a bad dtype on one rank is reported as such). On a 2-D mesh a shard group's verdict
    travels over the replicate group, which meets every shard group.

    Args:
        error: this rank's local error, or ``None``.
        fingerprint: this rank's fingerprint of the plan and dtypes.
        groups: the process groups spanning the mesh, shard group first.

    Raises:
        BaseException: the consensus error, on every rank, when anything differs or failed.
    """
    agree_on = f"DBuffer plan/dtype fingerprint {fingerprint}"
    *first, last = groups
    for group in first:
        try:
            raise_on_any_rank(error, group, agree_on=agree_on)
        except Exception as found:  # noqa: BLE001 - carried to the next group's consensus
            error = found
    raise_on_any_rank(error, last, agree_on=agree_on)
