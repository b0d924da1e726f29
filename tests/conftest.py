"""Session-wide fixtures shared by every package's tests."""

from __future__ import annotations

import os

# Triton kernels are exercised on CPU tensors under the interpreter; the variable must be set
# before triton is first imported, and spawned rank workers inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest

from tests.harness import RankPools


@pytest.fixture(scope="session")
def ranks() -> Iterator[RankPools]:
    """Persistent gloo rank pools: ``ranks.run(world_size, fn, *args)`` runs ``fn`` on every
    rank of a pool of that size and returns the per-rank results."""
    pools = RankPools()
    yield pools
    pools.close()
