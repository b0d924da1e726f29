"""Loading full (unsharded) state dicts into RaggedShard DTensors.

``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True`` turn each
full tensor into the target DTensor's local piece in ``torch.distributed._state_dict_utils``,
which knows only torch's placements:

* without ``broadcast_from_rank0``, ``_distribute_state_dict`` calls torch's
  ``distribute_tensor``, which rejects a ``RaggedShard``;
* with it, ``_broadcast_state_dict`` hands each tensor to ``_broadcast_tensors``, which
  broadcasts the FULL tensor to every rank and slices it with
  ``compute_local_shape_and_global_offset`` (blind to ``RaggedShard``: wrong shapes).

:mod:`ragged_dtensor.torch_patches` replaces those two names in that module with dispatchers
that keep torch's code for every other tensor. For a RaggedShard DTensor, without broadcast every rank cuts its
run from its own full tensor (no communication: every rank holds the full state dict); with
broadcast rank 0 sends each rank only its run in one ``all_to_all_single`` per tensor,
received straight into the DTensor's local tensor, so no other rank ever holds the full tensor
and a parameter is loaded in place (its local tensor keeps its storage, which matters where
parameters are views of a flat buffer).

The full form of ``get_model_state_dict`` / ``get_optimizer_state_dict`` needs nothing here: it
redistributes each DTensor to ``Replicate``, which :mod:`ragged_dtensor.redistribute` serves.

Two of torch's own decisions in loading a full state dict are made from each rank's own
arguments, although under ``broadcast_from_rank0`` only rank 0 holds the state dicts;
:mod:`ragged_dtensor.torch_patches` also wraps ``torch.distributed.checkpoint.state_dict``'s
``_verify_options`` and loaders so that every rank decides alike. They act only for a model
that holds a RaggedShard DTensor (a parameter or buffer); any other model's load is torch's
own, errors included:

* ``set_state_dict`` loads the model only where ``model_state_dict`` is not empty, so ranks
  other than 0 (which pass ``{}``) skipped the model's broadcasts and rank 0 hung in them;
  with ``broadcast_from_rank0`` rank 0's choice is broadcast first.
* ``strict=True`` was checked where the state dict is: a missing optimizer state raised on
  rank 0 alone, before the broadcast its peers then waited in, and a key the model does not
  have raised on rank 0 alone after the load; without ``broadcast_from_rank0`` a missing
  model key raised nothing (torch fills the dict it loads with the model's own tensors).
  With ``full_state_dict`` and ``strict`` the keys are now checked before anything is loaded:
  a model key missing from the state dict or unknown to the model, or a parameter with no
  optimizer state. Under ``broadcast_from_rank0`` rank 0 checks and the same
  ``RuntimeError`` is raised on every rank (:func:`ragged_dtensor.raise_on_any_rank`);
  otherwise each rank checks the dict it holds and raises with no collective, since a full
  load may run on some ranks only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as _dsd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor.api import distribute_tensor as ragged_distribute_tensor
from ragged_dtensor.api import from_local_run
from ragged_dtensor.composed import is_tp_shard, is_uneven, tp_box
from ragged_dtensor.consensus import _flag_device, raise_on_any_rank
from ragged_dtensor.peer_failure import collective_guard
from ragged_dtensor.placement import RaggedShard, find_ragged, is_ragged
from ragged_dtensor.torch_patches import torch_original

_SOURCE_RANK = 0  # torch's broadcast_from_rank0 source: global rank 0


def _distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``_distribute_state_dict``'s ``distribute_tensor``: a RaggedShard run is cut from this
    rank's own full tensor (every rank holds the full state dict, so nothing is sent)."""
    if placements is not None and is_ragged(placements):
        return ragged_distribute_tensor(tensor, device_mesh, placements, src_data_rank=None)
    return _TORCH_DISTRIBUTE_TENSOR(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def _group_runs(key: str, dtensor: DTensor, group: dist.ProcessGroup) -> list[_Run]:
    """The run each rank of ``group`` owns, in group-rank order (empty for a rank outside
    the DTensor's mesh). Beside tensor-parallel ``Shard`` placements a rank's run is a flat
    range of its TP-local tensor (:mod:`ragged_dtensor.composed`), so the run also records
    that tensor's box in the global one. Where an uneven TP cut gives ranks at different TP
    coordinates different TP-local shapes, each rank's RaggedShard describes only its own
    data-parallel group, so the runs are gathered from their owners (one small all-gather on
    ``group``; every rank takes that branch alike, from global facts).

    Raises:
        ValueError: if a mesh dim other than the ragged one is neither ``Replicate`` nor a
            tensor-parallel ``Shard`` (raised on every rank alike: that is a global fact).
    """
    found = find_ragged(dtensor.placements)
    assert found is not None
    mesh_dim, placement = found
    placements = dtensor.placements
    if not all(isinstance(p, (Replicate, RaggedShard)) or is_tp_shard(p) for p in placements):
        raise ValueError(
            f"full state dict entry {key!r}: loading into a RaggedShard DTensor needs every "
            f"other mesh dim to be Replicate or Shard, got placements {placements}"
        )
    mesh = dtensor.device_mesh
    shape = tuple(dtensor.shape)
    ranks = mesh.mesh.reshape(-1).tolist()
    index = torch.unravel_index(torch.arange(len(ranks)), tuple(mesh.mesh.shape))
    coordinates = {rank: tuple(int(i[n]) for i in index) for n, rank in enumerate(ranks)}

    def run_of(coordinate: tuple[int, ...]) -> _Run:
        origin, inner = tp_box(mesh, placements, shape, coordinate)
        start, end = placement.flat_range(inner, coordinate[mesh_dim])
        box = None if inner == shape else tuple(slice(o, o + n) for o, n in zip(origin, inner))
        return _Run(start, end, box)

    members = dist.get_process_group_ranks(group)
    if is_uneven(mesh, placements, shape):
        mine = coordinates.get(dist.get_rank())
        runs: list[_Run | None] = [None] * len(members)
        with collective_guard("all_gather_object (full state dict: ragged runs)", group):
            dist.all_gather_object(runs, None if mine is None else run_of(mine), group=group)
        return [_Run(0, 0, None) if run is None else run for run in runs]
    return [run_of(coordinates[rank]) if rank in coordinates else _Run(0, 0, None)
            for rank in members]


@dataclass(frozen=True)
class _Run:
    """A rank's flat run ``[start, end)`` of the full tensor, or of its box of it (the
    TP-local tensor, beside tensor-parallel ``Shard`` placements)."""

    start: int
    end: int
    box: tuple[slice, ...] | None

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The run's elements of ``full``."""
        source = full if self.box is None else full[self.box]
        return source.reshape(-1)[self.start:self.end]


def _send_buffer(full: torch.Tensor, runs: list[_Run]) -> torch.Tensor:
    """Rank 0's input to the scatter: the runs in group order, one after another (the flat
    tensor itself, no copy, when they already tile it in order, as on a 1-D mesh)."""
    flat = full.reshape(-1)
    pieces = [run for run in runs if run.end > run.start]
    starts, ends = [r.start for r in pieces], [r.end for r in pieces]
    if not pieces or (all(r.box is None for r in pieces) and starts == [0] + ends[:-1]
                      and ends[-1] == flat.numel()):
        return flat
    return torch.cat([run.of(full) for run in pieces])


def scatter_full_tensor(
    key: str,
    full: torch.Tensor | None,
    size: torch.Size,
    dtype: torch.dtype,
    local_state: DTensor,
    device: torch.device,
    group: dist.ProcessGroup,
) -> DTensor:
    """Load rank 0's full tensor into a RaggedShard DTensor, each rank receiving only its run.

    One ``all_to_all_single`` in which only rank 0 sends. When the DTensor holds real memory of
    the full tensor's dtype on a device the group can use, the run is received straight into
    its local tensor and the DTensor itself is returned (loaded in place); a meta DTensor gets
    a new local run (of the full tensor's dtype, as torch does).

    Args:
        key: the state-dict key (for errors).
        full: the full tensor on rank 0; ``None`` elsewhere.
        size: the full tensor's shape (known on every rank).
        dtype: the full tensor's dtype (known on every rank).
        local_state: the RaggedShard DTensor to load into.
        device: the device of the state dict's tensors.
        group: the process group rank 0 broadcasts on (all ranks call this).

    Returns:
        The loaded DTensor.

    Raises:
        ValueError: on every rank, if the shapes differ or the placements are unsupported.
    """
    if tuple(size) != tuple(local_state.shape):
        raise ValueError(
            f"full state dict entry {key!r} has shape {tuple(size)} but the RaggedShard "
            f"DTensor it loads into has shape {tuple(local_state.shape)}"
        )
    runs = _group_runs(key, local_state, group)
    me = dist.get_rank(group)
    source = dist.get_group_rank(group, _SOURCE_RANK)
    group_devices = {d.type for d in group._device_types}
    comm_device = device if device.type in group_devices else group._device_types[0]
    local = local_state._local_tensor
    in_place = (
        not local_state.is_meta
        and local.dtype == dtype
        and local.device == comm_device
        and local.is_contiguous()
    )
    start, end = runs[me].start, runs[me].end
    if in_place:
        received = local.detach()
    else:
        received = torch.empty(end - start, dtype=dtype, device=comm_device)
    sizes = [run.end - run.start for run in runs]
    if me == source:
        assert full is not None
        send = _send_buffer(full.detach().to(comm_device), runs)
        in_splits = sizes
    else:
        send = torch.empty(0, dtype=dtype, device=comm_device)
        in_splits = [0] * len(runs)
    out_splits = [0] * len(runs)
    out_splits[source] = end - start
    with collective_guard("all_to_all (broadcast_from_rank0)", group):
        dist.all_to_all_single(received, send, out_splits, in_splits, group=group)
    if in_place:
        return local_state
    if local_state.is_meta:
        return from_local_run(
            received.to(device), local_state.device_mesh, local_state.placements, local_state.shape
        )
    local.copy_(received)
    return local_state


def _broadcast_tensors(
    full_state_dict: dict[str, Any],
    local_state_dict: dict[str, Any],
    keys: list[str],
    device: torch.device,
    pg: dist.ProcessGroup | None = None,
) -> None:
    """``_broadcast_state_dict``'s ``_broadcast_tensors``: RaggedShard targets are scattered by
    :func:`scatter_full_tensor`, the other keys go to torch's function unchanged."""
    group = pg if pg is not None else dist.distributed_c10d._get_default_group()
    others = []
    for key in keys:
        local_state = local_state_dict.get(key)
        if not (isinstance(local_state, DTensor) and is_ragged(local_state)):
            others.append(key)
            continue
        value = full_state_dict[key]
        on_source = dist.get_rank() == _SOURCE_RANK
        local_state_dict[key] = scatter_full_tensor(
            key,
            value if on_source else None,
            value.size() if on_source else value.size,
            value.dtype,
            local_state,
            device,
            group,
        )
    if others:
        _TORCH_BROADCAST_TENSORS(full_state_dict, local_state_dict, others, device, pg)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _holds_ragged(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a RaggedShard DTensor parameter or buffer: the loads these wrappers
    change (every rank holds the same model, so every rank decides alike)."""
    return any(isinstance(t, DTensor) and is_ragged(t)
               for t in (*model.parameters(), *model.buffers()))


def _verify_options(
    model: torch.nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    **kwargs: Any,
) -> Any:
    """``state_dict._verify_options`` with rank 0's ``optim_only`` under ``broadcast_from_rank0``.

    ``set_state_dict`` passes ``optim_only=not model_state_dict``, so a rank that passes
    ``{}`` as it must under ``broadcast_from_rank0`` would skip the model while rank 0 loads
    it (and waits for that rank in the model's broadcasts). Every caller of ``_verify_options``
    calls it on every rank, so one broadcast of rank 0's flag makes every rank do as rank 0.
    Without optimizers (``set_model_state_dict``) there is nothing to decide: no broadcast.
    """
    options = kwargs.get("options")
    if (optims and options is not None and options.broadcast_from_rank0 and _distributed()
            and _holds_ragged(model)):
        flag = torch.tensor([int(bool(optim_only))], device=_flag_device(None))
        with collective_guard("broadcast (broadcast_from_rank0: what to load)", None):
            dist.broadcast(flag, src=_SOURCE_RANK)
        optim_only = bool(flag.item())
    return _TORCH_VERIFY_OPTIONS(model, optims, optim_only, **kwargs)


def _deciding_rank(info: Any) -> bool:
    """Whether this rank holds the state dict to check: rank 0 under ``broadcast_from_rank0``
    (the others pass ``{}``), every rank otherwise."""
    return not info.broadcast_from_rank0 or not _distributed() or dist.get_rank() == _SOURCE_RANK


def _listing(keys: set[str]) -> str:
    shown = sorted(keys)[:8]
    more = f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
    return ", ".join(repr(k) for k in shown) + more


def _model_key_error(model: torch.nn.Module, state_dict: dict[str, Any], info: Any
                     ) -> BaseException | None:
    """The strict check of a full model state dict's keys against the model's: the keys of
    ``model.state_dict()`` as canonical FQNs (persistent buffers, extra states and a shared
    submodule under each of its names included, as ``get_model_state_dict`` gives them)."""
    expected: set[str] = set()
    for key in model.state_dict(keep_vars=True):
        expected |= _dsd._get_fqns(model, key, info.dsd_fqn_modifiers)
    missing, unexpected = expected - set(state_dict), set(state_dict) - expected
    if not missing and not unexpected:
        return None
    parts = []
    if missing:
        parts.append(f"missing key(s) {_listing(missing)}")
    if unexpected:
        parts.append(f"unexpected key(s) {_listing(unexpected)}")
    source = "rank 0's " if info.broadcast_from_rank0 else ""
    return RuntimeError(
        f"loading a full state dict with strict=True: {source}model state dict does not match "
        f"the model: {'; '.join(parts)} (StateDictOptions(strict=False) loads the keys both "
        "have)"
    )


def _optim_key_error(model: torch.nn.Module, optims: tuple[torch.optim.Optimizer, ...],
                     state_dict: dict[str, Any], info: Any) -> BaseException | None:
    """torch's own strict check of a full optimizer state dict (every parameter that requires
    grad has a state, from ``_split_optim_state_dict``), run before anything is sent. State
    for parameters no optimizer given holds is allowed, as torch allows it (one state dict of
    several optimizers loads into each of them)."""
    if not isinstance(state_dict, dict) or _dsd._STATE not in state_dict:
        return None  # a flattened optimizer state dict: torch's own checks
    if all(isinstance(k, int) for k in state_dict[_dsd._STATE]):
        return None  # keyed by parameter index (torch's split passes it through)
    source = "rank 0's " if info.broadcast_from_rank0 else ""
    what = f"loading a full state dict with strict=True: {source}optimizer state dict"
    for optim in optims:
        try:
            _dsd._split_optim_state_dict(model, optim, state_dict, info)
        except (RuntimeError, ValueError) as exc:
            return type(exc)(f"{what}: {exc}")
    return None


def _raise_key_error(error: BaseException | None, info: Any) -> None:
    """Under ``broadcast_from_rank0`` only rank 0 can check, and every rank is in the load, so
    its verdict is raised on every rank; otherwise each rank checks the dict it was given and
    raises with no collective (a full load may run on some ranks only)."""
    if info.broadcast_from_rank0 and _distributed():
        raise_on_any_rank(error)
    elif error is not None:
        raise error


def _load_model_state_dict(model: torch.nn.Module, state_dict: dict[str, Any], info: Any) -> Any:
    """``state_dict._load_model_state_dict`` after the strict key check of a full state dict
    (see the module's docstring)."""
    checks = (info.handle_model and info.strict and info.full_state_dict
              and not info.submodule_prefixes and (state_dict or info.broadcast_from_rank0)
              and _holds_ragged(model))
    if checks:
        error = _model_key_error(model, state_dict, info) if _deciding_rank(info) else None
        _raise_key_error(error, info)
    return _TORCH_LOAD_MODEL_STATE_DICT(model, state_dict, info)


def _load_optim_state_dict(model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
                           state_dict: Any, info: Any) -> None:
    """``state_dict._load_optim_state_dict`` after the strict check of a full optimizer state
    dict, before anything is sent (see the module's docstring)."""
    if info.handle_optim and info.strict and info.full_state_dict and _holds_ragged(model):
        error = None
        if _deciding_rank(info) and state_dict:
            error = _optim_key_error(model, optimizers, state_dict, info)
        _raise_key_error(error, info)
    return _TORCH_LOAD_OPTIM_STATE_DICT(model, optimizers, state_dict, info)


_TORCH_DISTRIBUTE_TENSOR = torch_original("torch.distributed._state_dict_utils.distribute_tensor")
_TORCH_BROADCAST_TENSORS = torch_original("torch.distributed._state_dict_utils._broadcast_tensors")
_TORCH_VERIFY_OPTIONS = torch_original("torch.distributed.checkpoint.state_dict._verify_options")
_TORCH_LOAD_MODEL_STATE_DICT = torch_original(
    "torch.distributed.checkpoint.state_dict._load_model_state_dict")
_TORCH_LOAD_OPTIM_STATE_DICT = torch_original(
    "torch.distributed.checkpoint.state_dict._load_optim_state_dict")


def patched_distribute_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``_state_dict_utils.distribute_tensor``."""
    return _distribute_tensor


def patched_broadcast_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``_state_dict_utils._broadcast_tensors``."""
    return _broadcast_tensors


def patched_verify_options(original: Callable[..., Any]) -> Callable[..., Any]:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``state_dict._verify_options``."""
    return _verify_options


def patched_load_model_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``state_dict._load_model_state_dict``."""
    return _load_model_state_dict


def patched_load_optim_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """The :mod:`ragged_dtensor.torch_patches` factory of ``state_dict._load_optim_state_dict``."""
    return _load_optim_state_dict
