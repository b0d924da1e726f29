"""DBuffer's checks and error types.

Local checks (a dtype, a plan that does not match the group) return or raise errors naming the
argument at fault; :func:`check_consistent` then makes every rank raise, with one small
all-gather, if any rank found a problem or if the ranks disagree on the buffer's plan, so no
rank is left waiting in the buffer's first collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

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


_PAYLOAD_BYTES = 1024
"""Bytes each rank contributes to the construction check: fingerprint, status, message."""

_ERROR_TYPES: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, RuntimeError)


def _encode(fingerprint: int, verdict: tuple[type[BaseException], str] | None,
            device: torch.device) -> torch.Tensor:
    """One rank's row: int64 fingerprint, a status byte (0 = fine, else 1 + the error type's
    index), a 2-byte length and the UTF-8 message (truncated to fit)."""
    row = bytearray(_PAYLOAD_BYTES)
    row[:8] = fingerprint.to_bytes(8, "little", signed=True)
    if verdict is not None:
        kind, text = verdict
        index = next((i for i, t in enumerate(_ERROR_TYPES) if issubclass(kind, t)),
                     len(_ERROR_TYPES) - 1)
        data = text.encode()[: _PAYLOAD_BYTES - 11]
        row[8] = 1 + index
        row[9:11] = len(data).to_bytes(2, "little")
        row[11:11 + len(data)] = data
    return torch.frombuffer(row, dtype=torch.uint8).to(device)


def _decode(row: bytes) -> tuple[int, tuple[type[BaseException], str] | None]:
    fingerprint = int.from_bytes(row[:8], "little", signed=True)
    if row[8] == 0:
        return fingerprint, None
    length = int.from_bytes(row[9:11], "little")
    return fingerprint, (_ERROR_TYPES[row[8] - 1], row[11:11 + length].decode(errors="replace"))


def _agree(fingerprint: int, verdict: tuple[type[BaseException], str] | None,
           group: dist.ProcessGroup, first: bool) -> tuple[type[BaseException], str] | None:
    """One all-gather of every rank's fingerprint and verdict over ``group``; every rank
    derives the same verdict from the same rows."""
    world = dist.get_world_size(group)
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    every = torch.empty(world * _PAYLOAD_BYTES, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(every, _encode(fingerprint, verdict, device), group=group)
    data = every.cpu().numpy().tobytes()
    rows = [_decode(data[r * _PAYLOAD_BYTES:(r + 1) * _PAYLOAD_BYTES]) for r in range(world)]
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    failed = [(rank, v) for rank, (_, v) in zip(ranks, rows) if v is not None]
    if failed:
        if first:  # local errors: name the ranks, as ragged_dtensor.raise_on_any_rank does
            text = "; ".join(f"rank {rank}: {v[1]}" for rank, v in failed)
            return failed[0][1][0], f"error on {len(failed)} rank(s): {text}"
        return failed[0][1][0], "; ".join(dict.fromkeys(v[1] for _, v in failed))
    if len({fp for fp, _ in rows}) > 1:
        listing = ", ".join(f"rank {g}: {fp:016x}" for g, (fp, _) in zip(ranks, rows))
        return ValueError, (f"DBuffer plan/dtype fingerprint differs across ranks ({listing}); "
                            "every rank must build the buffer from the same plan and dtypes")
    return None


def check_consistent(error: BaseException | None, fingerprint: int,
                     groups: Sequence[dist.ProcessGroup]) -> None:
    """Raise on every rank if any rank passed an error or the fingerprints differ.

    One small all-gather per group (one on a 1-D group, one per dimension of a 2-D mesh):
    each rank contributes its fingerprint and its local error (type and message) in a fixed
    1 KiB row, so every rank sees every row and raises the same error. A local error wins
    over a fingerprint difference (a bad dtype on one rank is reported as such). On a 2-D
    mesh the verdict of the shard group travels over the replicate group, which meets every
    shard group.

    Args:
        error: this rank's local error, or ``None``.
        fingerprint: this rank's :func:`fingerprint_int` of the plan and dtypes.
        groups: the process groups spanning the mesh, shard group first.

    Raises:
        BaseException: the consensus error, on every rank, when anything differs or failed.
    """
    verdict = None if error is None else (type(error), f"{type(error).__name__}: {error}")
    for index, group in enumerate(groups):
        verdict = _agree(fingerprint, verdict, group, first=index == 0)
    if verdict is not None:
        raise verdict[0](verdict[1]) from error
