"""DBuffer's checks and error types.

Local checks (a dtype, a plan that does not match the group) return or raise errors naming the
argument at fault; :func:`check_consistent` then makes every rank raise if any rank found a
problem or if the ranks disagree on the buffer's plan, so no rank is left waiting in the
buffer's first collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from ragged_dtensor import raise_on_any_rank

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


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


def fingerprint_int(*parts: str) -> int:
    """A stable signed 63-bit hash of strings, sized to travel in one int64 element."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _mismatch(fingerprint: int, group: dist.ProcessGroup) -> ValueError | None:
    world = dist.get_world_size(group)
    mine = torch.tensor([fingerprint], dtype=torch.int64)
    every = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine, group=group)
    values = every.tolist()
    if len(set(values)) == 1:
        return None
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    listing = ", ".join(f"rank {g}: {v:016x}" for g, v in zip(ranks, values))
    return ValueError(f"DBuffer plan/dtype fingerprint differs across ranks ({listing}); "
                      "every rank must build the buffer from the same plan and dtypes")


def _spread(error: BaseException | None,
            groups: Sequence[dist.ProcessGroup]) -> BaseException | None:
    """Consensus over several groups: after the shard group, the replicate group (which meets
    every shard group) carries an error to every rank of a 2-D mesh."""
    for group in groups:
        try:
            raise_on_any_rank(error, group)
        except BaseException as spread:  # noqa: BLE001 - returned and raised by the caller
            error = spread
    return error


def raise_everywhere(error: BaseException | None,
                     groups: Sequence[dist.ProcessGroup]) -> None:
    """Raise on every rank of the mesh spanned by ``groups`` if any rank passed an error.

    Args:
        error: this rank's error, or ``None``.
        groups: the process groups spanning the mesh, shard group first.

    Raises:
        BaseException: the consensus error, on every rank.
    """
    error = _spread(error, groups)
    if error is not None:
        raise error


def check_consistent(error: BaseException | None, fingerprint: int,
                     groups: Sequence[dist.ProcessGroup]) -> None:
    """Raise on every rank if any rank passed an error or the fingerprints differ.

    Local errors are agreed on first (so a bad dtype on one rank is reported as such, not as
    a fingerprint difference), then the fingerprints are compared with one small all-gather
    per group. Every rank of a group sees the same gathered fingerprints and raises the same
    error; on a 2-D mesh the error is then spread over the other dimension.

    Args:
        error: this rank's local error, or ``None``.
        fingerprint: this rank's :func:`fingerprint_int` of the plan and dtypes.
        groups: the process groups spanning the mesh, shard group first.

    Raises:
        BaseException: the consensus error, on every rank, when anything differs or failed.
    """
    raise_everywhere(error, groups)
    mismatches = [_mismatch(fingerprint, group) for group in groups]
    mismatch = next((m for m in mismatches if m is not None), None)
    if len(groups) > 1:
        mismatch = _spread(mismatch, groups)
    if mismatch is not None:
        raise mismatch
