"""The TP-local box beside a RaggedShard (``ragged_dtensor.composed``) under uneven ``Shard``
cuts, for every mesh coordinate, against torch's own local shape and offset; and the two
global facts derived from it (``is_uneven``, ``smallest_tp_numel``) against brute force.

One process: the functions read only the mesh's sizes and a coordinate, so a stand-in mesh
of any shape serves.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard

from ragged_dtensor import RaggedShard
from ragged_dtensor.composed import is_uneven, ragged_shape, smallest_tp_numel, tp_box


@dataclass(frozen=True)
class _Mesh:
    """The sizes of a device mesh (all these functions read of it)."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int) -> int:
        return self.shape[dim]


def _cases(count: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple]]:
    rng = random.Random(17)
    cases = []
    while len(cases) < count:
        mesh = tuple(rng.choice((1, 2, 3, 4)) for _ in range(rng.choice((2, 3))))
        shape = tuple(rng.randint(1, 13) for _ in range(rng.choice((1, 2, 3))))
        ragged_dim = rng.randrange(len(mesh))
        placements = tuple(
            RaggedShard((0,), (1,) * mesh[d]) if d == ragged_dim
            else rng.choice((Replicate(), Shard(rng.randrange(len(shape)))))
            for d in range(len(mesh))
        )
        cases.append((mesh, shape, placements))
    return cases


@pytest.mark.parametrize("mesh_shape, shape, placements", _cases(60))
def test_tp_box_is_torchs_local_shape_and_offset(mesh_shape, shape, placements) -> None:
    mesh = _Mesh(mesh_shape)
    # torch's view of the same cuts, with the RaggedShard's mesh dim replicated
    torch_placements = [Replicate() if isinstance(p, RaggedShard) else p for p in placements]
    shapes = set()
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), torch_placements)
        origin, inner = tp_box(mesh, placements, shape, coordinate)
        assert inner == tuple(local) == ragged_shape(mesh, placements, shape, coordinate)
        if math.prod(inner):
            assert origin == tuple(offset), (coordinate, origin, offset)
        shapes.add(inner)
    assert is_uneven(mesh, placements, shape) == (len(shapes) > 1)
    assert smallest_tp_numel(mesh, placements, shape) == min(math.prod(s) for s in shapes)


def test_an_odd_hidden_size_is_cut_as_torch_chunk() -> None:
    mesh = _Mesh((2, 2))
    placements = (RaggedShard((0,), (1, 1)), Shard(0))
    assert [tp_box(mesh, placements, (201, 8), (0, tp)) for tp in (0, 1)] == [
        ((0, 0), (101, 8)), ((101, 0), (100, 8))]
    assert is_uneven(mesh, placements, (201, 8)) and not is_uneven(mesh, placements, (200, 8))
    assert smallest_tp_numel(_Mesh((2, 4)), placements, (5, 8)) == 0  # rows 2, 2, 1, 0
