"""Raise an error found on one rank on every rank, so no rank is left waiting in a collective.

Distributed code validates its inputs locally (a wrong local size, a bad placement), but a rank
that raises alone leaves its peers blocked in the next collective until the timeout. Every
rank therefore calls :func:`raise_on_any_rank` at the point where it would raise: one small
all-reduce of a flag on the happy path, and only on failure an ``all_gather_object`` of the
messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rebuild(exc_type: type[BaseException], message: str) -> BaseException:
    try:
        return exc_type(message)
    except Exception:  # noqa: BLE001 - types whose constructor wants other arguments
        return RuntimeError(message)


def raise_on_any_rank(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Collectively check for an error: if any rank of ``group`` passes one, every rank raises.

    Every rank of ``group`` must call this at the same point. The raised exception has the
    type of the lowest failing rank's error and a message naming every failing rank with its
    message, so all ranks fail the same way; on a failing rank the original error is chained
    as ``__cause__``.

    Args:
        error: this rank's error, or ``None`` when this rank is fine.
        group: the process group (default: the default group). Without an initialised
            process group, ``error`` itself is raised.

    Raises:
        BaseException: the consensus error, when any rank passed one.
    """
    if not dist.is_available() or not dist.is_initialized():
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    mine = None if error is None else (type(error), f"{type(error).__name__}: {error}")
    gathered: list[tuple[type[BaseException], str] | None] = [mine]
    if world > 1:
        flag = torch.tensor([int(error is not None)], dtype=torch.int32, device=_flag_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    elif error is None:
        return
    failed = [(rank, item) for rank, item in enumerate(gathered) if item is not None]
    exc_type = failed[0][1][0]
    message = "; ".join(
        f"rank {dist.get_global_rank(group, rank) if group is not None else rank}: {text}"
        for rank, (_, text) in failed
    )
    raise _rebuild(exc_type, f"error on {len(failed)} rank(s): {message}") from error
