"""One ``all_to_all_single`` that moves pieces of many tensors, of any dtypes, with a status flag.

Pieces are packed as raw bytes, so tensors of mixed dtypes share one collective (rather than
one collective per dtype); each piece starts at a 16-byte aligned offset so the receiver can
view it back in its dtype without a copy. Every destination segment opens with a 16-byte
header carrying the sender's status (the index of a tensor whose local size was wrong, and
that size). Since every rank receives a header from every rank, a bad local tensor on one
rank makes every rank raise the same ``ValueError`` right after the collective, and no rank
is left waiting in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ragged_dtensor.peer_failure import collective_guard

ALIGN = 16
_HEADER = ALIGN


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def exchange(
    sends: Sequence[Sequence[torch.Tensor]],
    recv_numels: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    group: dist.ProcessGroup | None,
    *,
    device: torch.device,
    bad: tuple[int, int] | None,
    describe: Callable[[int, int, int], str],
) -> list[list[torch.Tensor]]:
    """All-to-all of ``len(sends)`` tensors' pieces in one ``all_to_all_single``.

    Args:
        sends: ``sends[i][q]`` is the 1-D piece of tensor ``i`` for rank ``q``.
        recv_numels: ``recv_numels[i][p]`` is the number of elements of tensor ``i`` that
            rank ``p`` sends here.
        dtypes: dtype of each tensor (the same on every rank).
        group: the process group.
        device: where the buffers live.
        bad: ``(tensor index, actual numel)`` when this rank's local tensor ``i`` has the wrong
            size (its pieces must still have the agreed sizes, e.g. zeros); else ``None``.
        describe: ``describe(i, rank, numel)`` words the error for tensor ``i`` of ``rank``.

    Returns:
        ``received[i][p]``: the 1-D piece of tensor ``i`` from rank ``p`` (views of one buffer).

    Raises:
        ValueError: on every rank, when any rank passed ``bad``.
    """
    world = dist.get_world_size(group)
    header = torch.zeros(2, dtype=torch.int64, device=device)
    if bad is not None:
        header[0], header[1] = bad[0] + 1, bad[1]
    header_bytes = header.view(torch.uint8)
    pads: dict[int, torch.Tensor] = {}

    def pad(nbytes: int) -> torch.Tensor:
        if nbytes not in pads:
            pads[nbytes] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return pads[nbytes]

    parts: list[torch.Tensor] = []
    in_splits = []
    for q in range(world):
        size = _HEADER
        parts.append(header_bytes)
        for i, tensor_sends in enumerate(sends):
            piece = tensor_sends[q].reshape(-1)
            nbytes = piece.numel() * piece.element_size()
            if nbytes:
                parts.append(piece.contiguous().view(torch.uint8))
            if _aligned(nbytes) > nbytes:
                parts.append(pad(_aligned(nbytes) - nbytes))
            size += _aligned(nbytes)
        in_splits.append(size)
    sizes = [torch.empty((), dtype=d).element_size() for d in dtypes]
    out_splits = [
        _HEADER + sum(_aligned(recv_numels[i][p] * sizes[i]) for i in range(len(dtypes)))
        for p in range(world)
    ]
    send_buf = torch.cat(parts)
    recv_buf = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    with collective_guard("all_to_all (RaggedShard exchange)", group):
        dist.all_to_all_single(recv_buf, send_buf, out_splits, in_splits, group=group)

    received: list[list[torch.Tensor]] = [[] for _ in dtypes]
    failures = []
    offset = 0
    for p in range(world):
        flag = recv_buf[offset : offset + _HEADER].view(torch.int64).tolist()
        if flag[0]:
            failures.append((flag[0] - 1, p, flag[1]))
        offset += _HEADER
        for i, dtype in enumerate(dtypes):
            nbytes = recv_numels[i][p] * sizes[i]
            received[i].append(recv_buf[offset : offset + nbytes].view(dtype))
            offset += _aligned(nbytes)
    if failures:
        raise ValueError("; ".join(describe(i, p, n) for i, p, n in failures))
    return received
