"""``DBuffer.reshard_to_group``: a rank keeps its piece of the unsharded buffer for a smaller
group, and the next ``all_gather`` rebuilds the buffer from the pieces with one all-gather over
that group, equal to the original tensors; after the shards change, the stale pieces are
dropped and the shards are gathered instead."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dbuffer import DBuffer, FreedBufferError
from tests.dbuffer.cases import full_tensors, random_plan
from tests.dbuffer.collective_log import record_collectives


def _pairs() -> dist.ProcessGroup:
    """Ranks {0, 1} and {2, 3}: every rank creates both groups, in the same order."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return groups[dist.get_rank() // 2]


def _gathered(buf: DBuffer, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: buf.unsharded_view(n).clone() for n in names}


def _case(seeds: list[int]) -> list[str]:
    pair = _pairs()
    problems = []
    for seed in seeds:
        p = random_plan(random.Random(seed), dist.get_world_size())
        full = full_tensors(p, seed)
        for kwargs in ({}, {"compute_dtype": torch.bfloat16}):
            buf = DBuffer.from_tensors(full, p, **kwargs)
            buf.all_gather()
            buf.reshard_to_group(pair)
            numel = p.world_size * p.shard_size
            assert buf.piece_numel == numel // 2 and not buf.is_unsharded
            with pytest.raises(FreedBufferError):
                buf.unsharded_view(p.entries[0].name)
            with record_collectives() as calls:
                buf.all_gather(async_op=True).wait()
            assert [(c.group_size, c.input_numel, c.output_numel) for c in calls] == [
                (2, numel // 2, numel)]
            assert buf.piece_numel == 0
            compute = kwargs.get("compute_dtype", torch.float32)
            for name, t in full.items():
                if not torch.equal(buf.unsharded_view(name), t.to(compute)):
                    problems.append(f"seed {seed} {kwargs}: {name} differs after the pair gather")
            # an optimizer step while resharded: the pieces are stale, the shards are gathered
            buf.reshard_to_group(pair)
            with torch.no_grad():
                buf.sharded_buffer.mul_(2)
            with record_collectives() as calls:
                buf.all_gather()
            assert [c.group_size for c in calls] == [4]
            for name, t in full.items():
                if not torch.equal(buf.unsharded_view(name), (2 * t).to(compute)):
                    problems.append(f"seed {seed} {kwargs}: {name} stale after the shards changed")
            buf.reshard_to_group(pair)
            buf.free_unsharded()
            assert buf.piece_numel == 0
    return problems


def test_pieces_rebuild_the_buffer_over_the_smaller_group(ranks) -> None:
    for problems in ranks.run(4, _case, [1, 2, 3]):
        assert problems == []


def _indivisible_case() -> str:
    from layout_planner import TensorSpec, plan

    p = plan([TensorSpec("w", 3, 1, (3,))], 3)
    buf = DBuffer.from_tensors({"w": torch.ones(3)}, p)
    buf.all_gather()
    # every rank joins one group (rank 2 its own), so that each registers as many groups:
    # torch names later local-synchronisation groups by that count
    pair = dist.new_group([0, 1])
    dist.new_group([2])
    if dist.get_rank() == 2:
        return ""
    with pytest.raises(ValueError) as info:
        buf.reshard_to_group(pair)
    assert buf.is_unsharded  # nothing was freed
    return str(info.value)


def test_a_group_that_cannot_hold_equal_pieces_raises(ranks) -> None:
    messages = ranks.run(3, _indivisible_case)
    assert messages[0] == messages[1] == ("DBuffer.reshard_to_group: a group of 2 ranks cannot hold equal "
                           "pieces of the 3-element unsharded buffer")
