"""User-facing constructors and views for RaggedShard DTensors.

torch's ``distribute_tensor`` rejects placements it does not know, so
:func:`distribute_tensor` distributes with ``Replicate`` in place of each ``RaggedShard`` and
then cuts the ragged run locally (no extra communication). :mod:`ragged_dtensor.torch_patches`
routes torch's own ``torch.distributed.tensor.distribute_tensor`` here too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor import composed, ragged_math
from ragged_dtensor.autograd_hooks import local_run_error
from ragged_dtensor.placement import RaggedShard, find_ragged, is_ragged
from ragged_dtensor.redistribute import redistribute_ragged_local_tensor
from ragged_dtensor.torch_patches import torch_original

_TORCH_DISTRIBUTE_TENSOR = "torch.distributed.tensor._api.distribute_tensor.__code__"


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``torch.distributed.tensor.distribute_tensor`` that also accepts ``RaggedShard``.

    Without a ``RaggedShard`` (or for a DTensor ``tensor``, which torch checks and returns)
    this is torch's function. With one, torch distributes the tensor with ``Replicate`` in its
    place (its checks, device move and broadcast from ``src_data_rank``) and each rank keeps
    its ragged run, a contiguous copy. The result is a leaf whose ``requires_grad`` follows
    ``tensor``. After :func:`ragged_dtensor.install`, torch's own ``distribute_tensor`` does
    the same.

    Args:
        tensor: the full tensor (the same on every rank unless ``src_data_rank`` broadcasts).
        device_mesh: the mesh (default: torch's default mesh).
        placements: one placement per mesh dim (default: torch's default, all Replicate).
        src_data_rank: rank whose data is used, as in torch; ``None`` uses each rank's own.

    Returns:
        The distributed tensor.

    Raises:
        ValueError: if a RaggedShard does not fit the shape or its mesh dimension (raised on
            every rank alike, since every rank checks the same global facts; beside an
            uneven tensor-parallel ``Shard`` a rank checks its RaggedShard against its own
            TP-local shape, :mod:`ragged_dtensor.composed`).
    """
    torch_distribute_tensor = torch_original(_TORCH_DISTRIBUTE_TENSOR)
    if placements is None or find_ragged(placements) is None or isinstance(tensor, DTensor):
        return torch_distribute_tensor(
            tensor, device_mesh, placements, src_data_rank=src_data_rank
        )
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if device_mesh is None:
        raise ValueError("distribute_tensor with a RaggedShard placement needs a device_mesh")
    placements = tuple(placements)
    if len(placements) != device_mesh.ndim:
        raise ValueError(
            f"distribute_tensor: {len(placements)} placements for a {device_mesh.ndim}-D mesh"
        )
    inner = composed.ragged_shape(device_mesh, placements, tuple(tensor.shape))
    for dim, placement in enumerate(placements):
        if isinstance(placement, RaggedShard):
            placement.check(inner, device_mesh.size(dim))
    stand_in = [Replicate() if isinstance(p, RaggedShard) else p for p in placements]
    replicated = torch_distribute_tensor(tensor, device_mesh, stand_in, src_data_rank=src_data_rank)
    target = DTensorSpec(
        device_mesh,
        placements,
        tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype),
    )
    local = redistribute_ragged_local_tensor(
        replicated._local_tensor.detach(), replicated._spec, target
    )
    return DTensor(local.requires_grad_(tensor.requires_grad), target,
                   requires_grad=tensor.requires_grad)


def _distribute_tensor_trampoline(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    # runs as torch's distribute_tensor (its globals, defaults and name): no free variables,
    # the import finds this module in sys.modules
    from ragged_dtensor.api import distribute_tensor

    return distribute_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def patched_distribute_tensor_code(original: object) -> object:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``distribute_tensor.__code__``: torch's
    function object gets code that calls :func:`distribute_tensor`, so every name bound to it
    (``from torch.distributed.tensor import distribute_tensor`` runs before any RaggedShard
    exists) accepts RaggedShard placements."""
    return _distribute_tensor_trampoline.__code__


def from_local_run(
    local: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
) -> DTensor:
    """Wrap this rank's run of a tensor as a DTensor, with no communication and no copy.

    The one way the packages build a RaggedShard DTensor from memory they already hold (a
    DBuffer view, optimizer state, an owner's result): the returned DTensor's local tensor is
    ``local`` itself (the same Python object, not an alias as ``DTensor.from_local`` makes), so
    in-place optimizer steps on the DTensor write into ``local`` and anything that fences
    ``local`` (DBuffer's freed-buffer guard) fences the DTensor too. The global stride is the
    contiguous one.

    Args:
        local: this rank's run, 1-D and contiguous for a ``RaggedShard`` placement.
        device_mesh: the mesh.
        placements: one placement per mesh dim.
        shape: the global shape.

    Returns:
        The DTensor (a leaf; ``requires_grad`` follows ``local``).

    Raises:
        ValueError: if ``local`` is not the run the placements give this rank, or the
            placements do not match the mesh (raised on this rank only: the checks need no
            communication).
        TypeError: if ``local`` is not a tensor.
    """
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"from_local_run: local must be a torch.Tensor, got {type(local).__name__}")
    shape = torch.Size(shape)
    placements = tuple(placements)
    if len(placements) != device_mesh.ndim:
        raise ValueError(
            f"from_local_run: {len(placements)} placements for a {device_mesh.ndim}-D mesh"
        )
    if is_ragged(placements):
        error = local_run_error(local, device_mesh, placements, shape)
        if error is not None:
            raise error
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    spec = DTensorSpec(device_mesh, placements, tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


def from_local_run_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """Wrap ``local`` as a DTensor placed exactly like ``like`` (its mesh, placements and
    global shape), sharing ``like``'s sharding spec: no placement or spec is built and no run
    is checked beyond its size, so a per-step path (a gradient per parameter per step) costs
    one DTensor construction, as FSDP2's sharded gradients do, without ``DTensor.__init__``'s
    wrappers (a third of the cost). The local tensor is ``local`` itself, as with
    :func:`from_local_run`.

    Args:
        local: this rank's run, the same size as ``like``'s local tensor (any dtype).
        like: the DTensor whose placement ``local`` shares (e.g. the parameter of a gradient).

    Returns:
        The DTensor (a leaf; ``requires_grad`` follows ``local``).

    Raises:
        ValueError: if ``local``'s shape differs from ``like``'s local tensor.
    """
    expected = like._local_tensor.shape
    if local.shape != expected:
        raise ValueError(f"from_local_run_like: local of shape {tuple(local.shape)} cannot be "
                         f"placed like a DTensor whose local tensor has shape {tuple(expected)}")
    spec = like._spec
    meta = spec.tensor_meta
    if meta is None or meta.dtype != local.dtype:
        shape, stride = like.shape, like.stride()
        spec = DTensorSpec(spec.mesh, spec.placements,
                           tensor_meta=TensorMeta(shape, stride, local.dtype))
    # DTensor.__new__ builds the whole object; DTensor(...) also calls __init__, which in
    # torch 2.13 does nothing but run under torch._disable_dynamo and an export marker, at
    # twice the cost of the construction itself (2.6 against 0.8 microseconds on CPU).
    # tests/ragged_dtensor/test_api.py checks that both give the same object.
    return DTensor.__new__(DTensor, local, spec, requires_grad=local.requires_grad)


def local_shaped(dtensor: DTensor) -> torch.Tensor:
    """The local tensor, shaped: a RaggedShard run as ``(prefix rows, *shape[k:])``.

    A RaggedShard local tensor is a flat run of whole prefix rows (``k = len(dims)``); this
    views it with the suffix dims restored, e.g. ``(rows, in_features)`` for a weight sharded
    over ``dims=(0,)``; beside tensor-parallel ``Shard`` placements the run is one of the
    TP-local tensor (:mod:`ragged_dtensor.composed`). Other placements' local tensors are returned as they are. The view is
    differentiable like ``to_local``.

    Args:
        dtensor: a DTensor.

    Returns:
        A view of ``dtensor.to_local()``.

    Raises:
        ValueError: if the local tensor's size is not whole prefix rows.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"local_shaped: dtensor must be a DTensor, got {type(dtensor).__name__}")
    local = dtensor.to_local()
    found = find_ragged(dtensor.placements)
    if found is None:
        return local
    mesh_dim, placement = found
    shape = composed.ragged_shape(dtensor.device_mesh, dtensor.placements, tuple(dtensor.shape))
    k = len(placement.dims)
    coord = dtensor.device_mesh.get_local_rank(mesh_dim)
    rows = ragged_math.unit_rows(shape, k, placement.local_units) * placement.local_units[coord]
    if local.numel() != rows * ragged_math.row_numel(shape, k):
        raise ValueError(
            f"local tensor of {local.numel()} elements on mesh coordinate {coord} is not the "
            f"{rows} rows of {shape[k:]} that {placement} gives it"
        )
    return local.view(rows, *shape[k:])
