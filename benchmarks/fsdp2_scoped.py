"""FSDP2's default collectives inside ``comm:`` profiler scopes, as DBuffer's are, so the
copies gloo makes while completing them count as backend copies on both sides of a
benchmark (one definition for benchmarks/dbuffer.py and benchmarks/train_step.py)."""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.profiler import record_function


class ScopedAllGather(DefaultAllGather):
    """FSDP2's default all-gather in a ``comm:all_gather`` scope."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function("comm:all_gather"):
            return super().__call__(*args, **kwargs)


class ScopedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter in a ``comm:reduce_scatter`` scope."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function("comm:reduce_scatter"):
            return super().__call__(*args, **kwargs)
