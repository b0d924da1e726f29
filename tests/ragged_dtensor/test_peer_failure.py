"""ragged_dtensor.peer_failure: a collective that fails because a peer failed names the peer.

End to end with RaggedShard redistributions on three plain-script ranks
(:mod:`tests.failing_job`): a rank that raises is named, with its error, by the others'
``PeerFailureError``; the unit cases pin down which errors count as a peer's failure.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.failing_job import assert_others_name, run_failing_job


def test_ragged_redistribute_names_the_rank_that_raised() -> None:
    outcomes, failed_at = run_failing_job(3, "ragged", "raise", victim=2)
    assert_others_name(outcomes, failed_at, 2, 30.0,
                       "rank 2 raised RuntimeError: rank 2 fails on purpose at step 2",
                       "all_to_all (RaggedShard exchange) over ranks [0-2] failed")


def test_peer_failure_error_survives_pickling() -> None:
    import pickle

    from ragged_dtensor import PeerFailureError

    error = PeerFailureError("all_gather failed", op="all_gather", group_ranks=[0, 1, 2],
                             raised={1: "RuntimeError: boom"}, silent=[2], store_error=None)
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.op, copy.group_ranks, copy.raised, copy.silent) == (
        "all_gather failed", "all_gather", [0, 1, 2], {1: "RuntimeError: boom"}, [2])


@pytest.mark.parametrize("message", [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:30401. This is typically caused by a remote worker crashing.",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:12718: Connection reset by peer.",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 5000ms for recv operation to complete",
    "Application timeout caused pair closure",
])
def test_transport_errors_are_told_from_argument_errors(message: str) -> None:
    """The messages are gloo's own, as measured on this machine's torch 2.13 build."""
    from ragged_dtensor.peer_failure import PeerFailureError, is_transport_error

    assert is_transport_error(RuntimeError(message))
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as exc:
            raise ValueError("wrapped") from exc
    except ValueError as wrapped:
        assert is_transport_error(wrapped)
    assert not is_transport_error(PeerFailureError("x", op="o", group_ranks=[], raised={},
                                                   silent=[], store_error=None))
    assert not is_transport_error(RuntimeError("output tensor size must be equal to world_size "
                                               "times input tensor size"))
    # the user's own connection error (a data loader's socket) is not a peer's failure
    assert not is_transport_error(ConnectionResetError(104, "Connection reset by peer"))


def _argument_error_passes_through() -> tuple[str, float]:
    from ragged_dtensor import collective_guard

    started = time.monotonic()
    try:
        with collective_guard("all_gather", None):
            dist.all_gather_single(torch.empty(3), torch.ones(2))
    except Exception as exc:  # noqa: BLE001 - returned for the assertion
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "no error", time.monotonic() - started


def test_argument_error_in_a_guarded_collective_is_not_a_peer_failure(ranks) -> None:
    """A collective's own bad arguments fail on the rank that passed them, unchanged, without
    a roll call (which would wait and then blame healthy peers)."""
    for text, seconds in ranks.run(2, _argument_error_passes_through):
        assert "PeerFailureError" not in text and text != "no error", text
        assert seconds < 1.0, (text, seconds)
