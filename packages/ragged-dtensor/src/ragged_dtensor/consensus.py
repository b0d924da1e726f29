"""Raise an error found on one rank on every rank, so no rank is left waiting in a collective.

Distributed code validates its inputs locally (a wrong local size, a bad placement), but a rank
that raises alone leaves its peers blocked in the next collective until the timeout. Every
rank therefore calls :func:`raise_on_any_rank` at the point where it would raise: one small
all-reduce of a flag on the happy path, and only on failure an ``all_gather_object`` of the
messages. The same all-reduce can also check that every rank holds the same value (a plan
fingerprint, say): a mismatch is one more way to fail, at no extra cost when all agree.

Ranks that share no single group (the ranks of a 2-D mesh: each rank's row group and column
group differ) agree through :func:`raise_on_any_rank_along`: the error travels along one group
after another before any rank raises it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ragged_dtensor.peer_failure import PeerFailureError, collective_guard


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


_FAILURES = "_ragged_dtensor_failures"


@dataclass(frozen=True)
class _Failure:
    """One failing rank's error, as a consensus error lists it."""

    rank: int  # the global rank
    exc_type: type[BaseException]
    text: str


def _failures(error: BaseException) -> list[_Failure]:
    """What this rank contributes to a consensus: its own error, or, for an error that is
    itself a consensus error (a rank relaying what an earlier group told it), the failures
    that one lists, so that a relay is not reported as one more failing rank."""
    relayed = getattr(error, _FAILURES, None)
    if relayed is not None:
        return list(relayed)
    return [_Failure(dist.get_rank(), _picklable(type(error)), f"{type(error).__name__}: {error}")]


def _picklable(exc_type: type[BaseException]) -> type[BaseException]:
    """``exc_type``, or its nearest base class that pickles: a class defined inside a function
    cannot cross ``all_gather_object``, and a pickling error on the failing rank alone would
    leave the other ranks waiting in that collective."""
    for cls in exc_type.__mro__:
        try:
            pickle.dumps(cls)
            return cls
        except Exception:  # noqa: BLE001 - any failure to pickle
            continue
    return RuntimeError


def _code(value: str | None) -> int:
    """``value`` as a non-negative 63-bit integer (0 for ``None``), to compare in an int64."""
    if value is None:
        return 0
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "little") >> 1


def raise_on_any_rank(error: BaseException | None, group: dist.ProcessGroup | None = None, *,
                      agree_on: str | None = None) -> None:
    """Collectively check for an error: if any rank of ``group`` passes one, every rank raises.

    Every rank of ``group`` must call this at the same point. The raised exception has the
    type of the lowest failing rank's error and a message naming every failing rank with its
    message, so all ranks fail the same way; on a failing rank the original error is chained
    as ``__cause__``. A consensus error passed in again (a rank relaying what an earlier
    group told it) counts as the failures it lists, not as one more failing rank.

    With ``agree_on``, the same collective also checks that every rank passed the same
    string (e.g. a fingerprint of a plan the ranks must share): one all-reduce of
    ``[flag, h, -h]`` with ``max`` finds both a failing rank and differing hashes ``h``.
    Errors win over a disagreement; a disagreement alone raises ``ValueError`` listing each
    rank's value.

    Args:
        error: this rank's error, or ``None`` when this rank is fine.
        group: the process group (default: the default group). Without an initialised
            process group, ``error`` itself is raised.
        agree_on: a value every rank must hold equally, or ``None`` for no such check.

    Raises:
        BaseException: the consensus error, when any rank passed one.
        ValueError: when the ranks' ``agree_on`` values differ (and no rank passed an error).
    """
    if error is not None and not isinstance(error, BaseException):
        # still goes through the collective, so every rank raises it
        error = TypeError(f"raise_on_any_rank: error must be an exception or None, got "
                          f"{type(error).__name__} {error!r}")
    if not dist.is_available() or not dist.is_initialized():
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    mine = None if error is None else _failures(error)
    gathered: list[tuple[list[_Failure] | None, str | None]] = [(mine, agree_on)]
    if world > 1:
        code = _code(agree_on)
        flags = torch.tensor([int(error is not None), code, -code], dtype=torch.int64,
                             device=_flag_device(group))
        with collective_guard("all_reduce (raise_on_any_rank)", group):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        failed_any, highest, lowest = (int(v) for v in flags.tolist())
        if not failed_any and highest == -lowest:
            return
        gathered = [None] * world  # type: ignore[list-item]
        with collective_guard("all_gather_object (raise_on_any_rank)", group):
            dist.all_gather_object(gathered, (mine, agree_on), group=group)
    elif error is None:
        return

    def global_rank(rank: int) -> int:
        return dist.get_global_rank(group, rank) if group is not None else rank

    failed = sorted({f.rank: f for item, _ in gathered if item is not None for f in item}.values(),
                    key=lambda f: f.rank)
    if not failed:
        listing = "; ".join(f"rank {global_rank(rank)}: {value}"
                            for rank, (_, value) in enumerate(gathered))
        raise ValueError(f"values that must agree differ across ranks ({listing})")
    message = "; ".join(f"rank {f.rank}: {f.text}" for f in failed)
    consensus = _rebuild(failed[0].exc_type, f"error on {len(failed)} rank(s): {message}")
    setattr(consensus, _FAILURES, failed)
    raise consensus from error


def raise_on_any_rank_along(error: BaseException | None,
                            steps: Sequence[tuple[dist.ProcessGroup, str | None]]) -> None:
    """:func:`raise_on_any_rank` over several groups in turn, raising only after the last:
    an error found on any rank travels along each group before any rank raises, so with the
    groups of every dim of a mesh (each rank its own group of each dim, the dims in the same
    order on every rank) every rank of the mesh raises. Raising on the first dim instead
    would leave the ranks of other rows waiting in the second dim's collective for ranks that
    had raised.

    One small all-reduce per group when all is well, as :func:`raise_on_any_rank`. Every
    rank raises an error naming the ranks that failed, not the ones that relayed.

    Args:
        error: this rank's error, or ``None``.
        steps: ``(group, agree_on)`` pairs, in order; ``agree_on`` as in
            :func:`raise_on_any_rank` (checked within that group only).

    Raises:
        BaseException: the consensus error, when any rank passed one.
        ValueError: when ``agree_on`` values differ within a group (and no rank failed).
        PeerFailureError: at once, when a collective itself fails (a peer died).
    """
    if not steps:
        raise ValueError("raise_on_any_rank_along: steps must name at least one group")
    for group, agree_on in steps[:-1]:
        try:
            raise_on_any_rank(error, group, agree_on=agree_on)
        except PeerFailureError:
            raise
        except Exception as caught:  # noqa: BLE001 - the consensus error has the failing rank's type
            error = error if error is not None else caught
    group, agree_on = steps[-1]
    raise_on_any_rank(error, group, agree_on=agree_on)
