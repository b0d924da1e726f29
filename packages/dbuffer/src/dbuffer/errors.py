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

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16,
                                          torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
"""The floating-point dtypes: the only ones DBuffer casts and its kernels compute on."""

BYTE_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
                                         torch.int32, torch.int16, torch.int8, torch.uint8,
                                         torch.bool)
"""Dtypes moved as raw bytes (gloo has no float8 or bool type) and held without arithmetic: a
DBuffer holding them has no gradients. FSDP2 takes them as frozen parameters (float8 weights,
an integer table registered as a ``Parameter`` with ``requires_grad=False``)."""

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(dict.fromkeys(FLOAT_DTYPES + BYTE_DTYPES))
"""Every dtype a DBuffer holds: the dtypes FSDP2 accepts for parameters (complex excepted)."""


class FreedBufferError(RuntimeError):
    """A view of a buffer was requested (or the buffer used) while its storage is freed."""


def check_dtype(dtype: torch.dtype, arg: str,
                supported: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """Raise ``TypeError`` unless ``dtype`` is one of ``supported``.

    Args:
        dtype: the dtype to check.
        arg: the name of the argument or tensor, for the message.
        supported: :data:`SUPPORTED_DTYPES` for a buffer, :data:`FLOAT_DTYPES` for a kernel.

    Raises:
        TypeError: for any dtype outside ``supported``.
    """
    if dtype not in supported:
        names = ", ".join(str(d) for d in supported)
        raise TypeError(f"{arg}: dtype {dtype} is not supported (supported: {names})")


def check_cast(source: torch.dtype, target: torch.dtype, arg: str) -> None:
    """Raise ``TypeError`` for a cast that involves an integer or bool dtype: those tensors
    are held and gathered as they are (as FSDP2 applies mixed precision to floating-point
    parameters only), so a cast to or from them is a mistake, not a conversion to make.

    Args:
        source: the dtype cast from.
        target: the dtype cast to (``arg``'s value).
        arg: the name of the argument holding ``target``, for the message.

    Raises:
        TypeError: when the two differ and either is not a floating-point dtype.
    """
    if source != target and not (source.is_floating_point and target.is_floating_point):
        raise TypeError(f"{arg}: dtype {target} is not supported for a cast from {source} (only "
                        "floating-point tensors are cast; integer and bool ones are held as "
                        "they are)")


def check_gradient_dtype(dtype: torch.dtype, arg: str) -> None:
    """Raise ``TypeError`` when gradients would be computed or reduced in ``dtype``.

    Args:
        dtype: a dtype of a buffer with trainable tensors.
        arg: the name of the argument, for the message.

    Raises:
        TypeError: for a dtype of :data:`BYTE_DTYPES` (no gradient arithmetic on bytes).
    """
    if dtype in BYTE_DTYPES:
        raise TypeError(f"{arg}: dtype {dtype} holds no gradients (float8, integer and bool "
                        "tensors are held as bytes): make them frozen (requires_grad=False / "
                        "requires_grad=())")


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
