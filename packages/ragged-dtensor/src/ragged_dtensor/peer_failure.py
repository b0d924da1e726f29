"""Name the rank at fault when a collective fails because another rank raised, died or hung.

A rank learns that a peer failed only through the next collective they share, and the
backend's error names a socket ("Connection closed by peer [10.0.0.7]:41234") or a timeout,
never a rank. In a job of thousands of ranks that leaves every survivor's log pointing
nowhere. The missing fact travels through the rendezvous store the ranks already share, as
an append-only log of one JSON line per event:

* a rank that exits on an uncaught exception logs ``raised`` with its error before it exits
  (a ``sys.excepthook`` chained in front of the existing one, installed with the rest of
  :mod:`ragged_dtensor.torch_patches` on the first use of RaggedShard; :func:`record_failure` does the same for code that catches
  the exception itself, such as a launcher's error recorder);
* a rank whose collective fails with a transport error (peer closed or reset the
  connection, the process group's timeout expired) logs ``alive`` and then reads the log
  until every rank of the collective's group is in it or the roll-call window
  (:func:`set_roll_call_timeout`, default ``5 s``) has passed. It then raises
  :class:`PeerFailureError` naming the ranks that raised, with their errors, and the ranks
  that never answered (killed, hung, or still blocked in another collective).

Collectives issued by the five packages run under :class:`collective_guard`, so their
failures raise :class:`PeerFailureError`; a transport error from any other collective (the
user's own ``all_reduce``, torch's DTensor or DCP internals) that ends the process uncaught
gets the same diagnosis attached as a note to its traceback by the excepthook.

Only transport errors are diagnosed: an error in a collective's own arguments is the
caller's and passes through unchanged. How soon a survivor notices at all is the backend's
business: gloo sees a closed connection at once, and a rank that hangs without dying is
noticed only when the process group's timeout (``init_process_group(timeout=...)``) expires.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

_LOG_KEY = "ragged_dtensor/peer_failure/log"
_COUNT_KEY = "ragged_dtensor/peer_failure/entries"
# gloo's own words (its messages carry its source path, except the last two) and the NCCL
# watchdog's; matched only in RuntimeErrors, the type torch raises them as, so an OSError of the
# user's own (a data loader's "Connection reset by peer") is never taken for a peer's failure.
_TRANSPORT_MARKERS = ("/gloo/transport/", "Connection closed by peer",
                      "Connection reset by peer", "Timed out waiting",
                      "Application timeout caused pair closure", "Socket closed",
                      "Watchdog caught collective operation timeout",
                      "NCCL communicator was aborted")
_MESSAGE_LIMIT = 2000
_roll_call_s = 5.0
_store_lock = threading.Lock()


class PeerFailureError(RuntimeError):
    """A collective failed on this rank because another rank failed.

    Attributes:
        op: the collective that failed here.
        group_ranks: the global ranks of the collective's group.
        raised: global rank -> the error it exited with, for ranks that logged one.
        silent: global ranks of the group that did not answer the roll call.
        store_error: why the store could not be read, or ``None``.
    """

    def __init__(self, message: str, *, op: str, group_ranks: list[int],
                 raised: dict[int, str], silent: list[int], store_error: str | None) -> None:
        super().__init__(message)
        self.op = op
        self.group_ranks = group_ranks
        self.raised = raised
        self.silent = silent
        self.store_error = store_error

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (str(self), self.op, self.group_ranks, self.raised, self.silent,
                           self.store_error))


def _rebuild(message: str, op: str, group_ranks: list[int], raised: dict[int, str],
             silent: list[int], store_error: str | None) -> PeerFailureError:
    return PeerFailureError(message, op=op, group_ranks=group_ranks, raised=raised,
                            silent=silent, store_error=store_error)


@dataclass
class RollCall:
    """What the store's log said about the ranks of one group."""

    raised: dict[int, str] = field(default_factory=dict)
    exited: list[int] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
    waited_s: float = 0.0
    store_error: str | None = None


def set_roll_call_timeout(seconds: float) -> None:
    """How long a rank whose collective failed waits for its peers to answer (default 5 s).

    It waits only while some rank of the group has neither answered nor logged an error: when
    the failed rank raised and the others notice at once, the roll call ends as soon as all
    have answered; a killed or hung rank, or one still blocked in another collective, costs
    the whole window.
    """
    global _roll_call_s
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"set_roll_call_timeout: seconds must be a number, got "
                        f"{type(seconds).__name__} {seconds!r}")
    if not seconds >= 0:
        raise ValueError(f"set_roll_call_timeout: seconds must be >= 0, got {seconds!r}")
    _roll_call_s = float(seconds)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not other for other in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says a connection to a peer failed
    or timed out, as opposed to a fault in the collective's own arguments."""
    for item in _chain(exc):
        if isinstance(item, PeerFailureError):
            return False
        if isinstance(item, dist.DistNetworkError):
            return True
        if isinstance(item, RuntimeError) and any(m in str(item) for m in _TRANSPORT_MARKERS):
            return True
    return False


@contextmanager
def _store() -> Iterator[dist.Store]:
    """The default group's store with the roll-call window as its timeout for the duration.

    The store's own timeout is the process group's (30 minutes by default), and a store
    whose host has died makes every operation wait that long; a second connection
    (``clone``) would first wait that long to connect. The shared client's timeout is
    therefore shortened and then restored, under a lock so that two threads (a training step
    and an asynchronous checkpoint's writer) cannot restore each other's setting.
    """
    with _store_lock:
        store = dist.distributed_c10d._get_default_store()
        previous = store.timeout
        store.set_timeout(datetime.timedelta(seconds=max(_roll_call_s, 1.0)))
        try:
            yield store
        finally:
            store.set_timeout(previous)


def _append(store: dist.Store, kind: str, message: str = "") -> None:
    """Add this rank's entry to the log and count it, so a roll call polls one counter and
    reads the log only when it has grown."""
    store.append(_LOG_KEY, json.dumps([dist.get_rank(), kind, message[:_MESSAGE_LIMIT]]) + "\n")
    store.add(_COUNT_KEY, 1)


def _read(store: dist.Store) -> dict[int, tuple[str, str]]:
    """rank -> (kind, message); a rank's strongest entry wins (raised > exited > alive)."""
    if not store.check([_LOG_KEY]):
        return {}
    strength = {"alive": 0, "exited": 1, "raised": 2}
    entries: dict[int, tuple[str, str]] = {}
    for line in store.get(_LOG_KEY).decode().splitlines():
        rank, kind, message = json.loads(line)
        if rank not in entries or strength[kind] > strength[entries[rank][0]]:
            entries[rank] = (kind, message)
    return entries


def roll_call(group_ranks: list[int]) -> RollCall:
    """Log this rank as alive, then wait (at most the roll-call window) until every rank of
    ``group_ranks`` is in the log; report who raised, who exited after a peer's failure and
    who never answered."""
    result = RollCall()
    entries: dict[int, tuple[str, str]] | None = None
    started = time.monotonic()
    try:
        with _store() as store:
            _append(store, "alive")
            deadline = time.monotonic() + _roll_call_s
            delay, counted = 0.05, -1
            while True:
                logged = store.add(_COUNT_KEY, 0)
                if logged != counted:
                    counted, entries = logged, _read(store)
                left = deadline - time.monotonic()
                if all(rank in entries for rank in group_ranks) or left <= 0:
                    break
                time.sleep(min(delay, left))
                delay = min(2 * delay, 1.0)
            entries = _read(store)  # entries logged since the last read
    except Exception as exc:  # noqa: BLE001 - an unreachable store is itself a finding
        result.store_error = _first_line(exc)
    result.waited_s = time.monotonic() - started
    if entries is None:  # nothing was read: no rank can be said to be silent
        return result
    for rank in group_ranks:
        kind, message = entries.get(rank, ("", ""))
        if kind == "raised":
            result.raised[rank] = message
        elif kind == "exited":
            result.exited.append(rank)
        elif not kind:
            result.silent.append(rank)
    return result


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _ranks_text(ranks: list[int]) -> str:
    """``[0-3, 8, 10-11]``: runs of consecutive ranks folded, so a group of 10K ranks prints
    as one range."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "]"


def _describe(call: RollCall) -> str:
    parts = [f"rank {rank} raised {message}" for rank, message in call.raised.items()]
    if call.silent:
        parts.append(f"rank(s) {_ranks_text(call.silent)} did not answer within "
                     f"{call.waited_s:.1f} s "
                     f"(killed, hung, or blocked in another collective)")
    if call.exited:
        parts.append(f"rank(s) {_ranks_text(call.exited)} exited after a peer's failure")
    if call.store_error is not None:
        parts.append(f"the rendezvous store stopped answering ({call.store_error}); unless "
                     f"a launcher such as torchrun holds it, rank 0 hosts it, so rank 0 has "
                     f"most likely exited")
    if not parts:
        parts.append("every rank answered, so the connection itself failed")
    return "; ".join(parts)


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def peer_failure(op: str, group: dist.ProcessGroup | None,
                 error: BaseException) -> PeerFailureError:
    """The :class:`PeerFailureError` for ``error``, a transport error that ``op`` raised on
    ``group``, after a roll call of the group's ranks."""
    ranks = _group_ranks(group)
    call = roll_call(ranks)
    message = (f"{op} over ranks {_ranks_text(ranks)} failed on rank {dist.get_rank()} because a peer "
               f"failed: {_describe(call)}. The backend reported {_first_line(error)}")
    return PeerFailureError(message, op=op, group_ranks=ranks, raised=call.raised,
                            silent=call.silent, store_error=call.store_error)


class collective_guard:  # noqa: N801 - used as a context manager, named like one
    """Run a collective; a transport error it raises becomes a :class:`PeerFailureError`.

    ``with collective_guard("all_gather", group): dist.all_gather_single(...)``. Any other
    error passes through unchanged.
    """

    __slots__ = ("_group", "_op")

    def __init__(self, op: str, group: dist.ProcessGroup | None) -> None:
        self._op = op
        self._group = group

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> bool:
        if exc is None or not is_transport_error(exc):
            return False
        raise peer_failure(self._op, self._group, exc) from exc


def record_failure(error: BaseException) -> None:
    """Log that this rank is exiting because of ``error``, for its peers' roll calls.

    The excepthook does this for uncaught exceptions; call it where an exception that ends
    the rank is caught instead (a launcher's error recorder, a test harness). An error that
    is itself a peer's failure is logged as ``exited``, so peers do not take it for the
    cause. Does nothing without an initialised process group; a store that cannot be
    reached is ignored (the error being recorded matters more).
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    follows = any(isinstance(item, PeerFailureError) for item in _chain(error))
    try:
        with _store() as store:
            if follows or is_transport_error(error):
                _append(store, "exited")
            else:
                _append(store, "raised", f"{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001, S110 - never hide the error being recorded
        pass


def _on_uncaught(error: BaseException) -> None:
    if not dist.is_available() or not dist.is_initialized():
        return
    if is_transport_error(error):
        call = roll_call(_group_ranks(None))
        error.add_note(f"[ragged_dtensor] a collective failed because a peer failed: "
                       f"{_describe(call)}")
    record_failure(error)


def chained_excepthook(previous: Callable[..., object]) -> Callable[..., None]:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``sys.excepthook``: log an uncaught
    exception for the peers' roll call, then run ``previous``."""

    def excepthook(exc_type: type[BaseException], error: BaseException,
                   tb: types.TracebackType | None) -> None:
        try:
            _on_uncaught(error)
        except Exception:  # noqa: BLE001, S110 - the original error must still be printed
            pass
        previous(exc_type, error, tb)

    return excepthook
