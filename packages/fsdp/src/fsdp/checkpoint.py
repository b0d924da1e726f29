"""Checkpoints for the training loop: ``save`` / ``load`` / ``latest`` over DCP.

A checkpoint is one directory ``<root>/step_<step:09d>`` holding DCP's files (each rank writes
only its own RaggedShard runs, as N-D boxes, so nothing is gathered and the checkpoint loads
into any world size, unit policy or plain model) and ``fsdp_checkpoint.json`` (step, world
size, the plan fingerprint of every DBuffer, package versions and the caller's ``extra``).

Crash safety comes from the order of the steps: every rank writes into a temporary sibling
directory ``<root>/.tmp-step_<step>``; rank 0 writes the JSON there; every rank reaches a
barrier; only then does rank 0 rename the directory to its final name (an atomic rename on one
file system). A crash at any point before the rename leaves a ``.tmp-`` directory, which
:func:`latest` and :func:`load` ignore, so the previous checkpoint stays the newest complete
one. Pruning (``keep_last``) runs only after the rename.

Every check that can fail on one rank only (a missing file, a model that does not match the
checkpoint) goes through :func:`ragged_dtensor.raise_on_any_rank`, so all ranks raise together
instead of one raising while the others wait in a collective.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ragged_dtensor import (
    PeerFailureError,
    collective_guard,
    from_local_run,
    is_ragged,
    raise_on_any_rank,
)
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fsdp.state import get_state

METADATA_FILE = "fsdp_checkpoint.json"
"""The JSON written by rank 0 into every checkpoint directory (its presence marks a checkpoint)."""
DCP_METADATA_FILE = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_GROUP: dist.ProcessGroup | None = None
_PACKAGES = ("torch", "fsdp", "ragged-dtensor", "dbuffer", "layout-planner", "block-optim")


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``fsdp_checkpoint.json`` records about one checkpoint.

    Attributes:
        path: the checkpoint directory.
        step: the training step passed to :func:`save`.
        world_size: the world size that wrote it.
        plan_fingerprints: module name -> the plan fingerprints of its DBuffers, in order (a
            checkpoint loads under any plan; these say which plan wrote it).
        versions: package -> installed version at save time.
        extra: the caller's JSON-serialisable ``extra``.
    """

    path: Path
    step: int
    world_size: int
    plan_fingerprints: dict[str, list[str]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    extra: Any = None


@dataclass
class AsyncSave:
    """A save in flight (``save(..., async_save=True)``): training may continue meanwhile.

    Call :meth:`result` on every rank before the next save or before exiting; it waits for
    DCP's upload, then finishes the checkpoint (barrier, rename, pruning) and returns its path.
    """

    _upload: Future
    _finish: Any

    def done(self) -> bool:
        """Whether DCP's upload has finished (the rename still needs :meth:`result`)."""
        return self._upload.done()

    def result(self) -> Path:
        """Wait for the upload, then rename the checkpoint into place; its final path."""
        raise_on_any_rank(_local_error("dcp.save (async)", self._upload.result))
        return self._finish()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        with collective_guard("barrier (checkpoint)", None):
            dist.barrier()


def _local_error(what: str, call: Callable[..., Any], *args: Any, **kwargs: Any
                 ) -> BaseException | None:
    """Run ``call``, one of DCP's collective steps, and return its error so that every rank
    can raise it together; a peer's failure is raised at once instead, since the failed peer
    cannot take part in that agreement."""
    try:
        with collective_guard(what, None):
            call(*args, **kwargs)
    except PeerFailureError:
        raise
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the caller
        return exc
    return None


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The final directory of the checkpoint of ``step`` under ``root``."""
    return Path(root) / f"step_{step:09d}"


def _is_complete(path: Path) -> bool:
    return (path / METADATA_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (highest step), or ``None``.

    Temporary directories of unfinished saves (``.tmp-step_*``) and step directories without
    both metadata files are ignored.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and _is_complete(p)]
    return max(found)[1] if found else None


def plan_fingerprints(model: nn.Module) -> dict[str, list[str]]:
    """Module name -> the plan fingerprints of the DBuffers of its ``fully_shard`` call."""
    out: dict[str, list[str]] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        state = get_state(module)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        out[name] = [buffer.plan.fingerprint() for group in state.groups
                     for buffer in group.buffers]
    return out


def _versions() -> dict[str, str]:
    out = {}
    for package in _PACKAGES:
        try:
            out[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            continue
    return out


def _check_path(path: object, what: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a str or os.PathLike, got {type(path).__name__}")


def _check_arguments(what: str, path: object, model: object, optimizer: object) -> None:
    """Name a ``path``, ``model`` or ``optimizer`` of the wrong type before anything is written
    or read (the same on every rank, so every rank raises)."""
    _check_path(path, what)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The sharded state dict DCP saves and loads: ``{"model": ..., "optim": ...}``."""
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _stage_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy that training cannot change, with the same (sharded) layout."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().clone()
    local = tensor.to_local().detach().clone()
    if is_ragged(tensor):
        return from_local_run(local, tensor.device_mesh, tensor.placements, tensor.shape)
    return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def _staged(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict with every tensor copied (local runs only: no communication).

    torch's own stager (``dcp.async_save``'s default) deep-copies each tensor's storage and
    fails on the views of a DBuffer that fsdp's parameters are, so fsdp stages itself.
    """
    return tree_map_only(torch.Tensor, _stage_tensor, state)


@functools.cache
def _writer() -> ThreadPoolExecutor:
    """The one background thread that runs asynchronous saves, in order."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-checkpoint")


def _checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of its own for background saves, so their collectives never interleave
    with training's on the default group (created once, by every rank)."""
    global _GROUP
    if not dist.is_initialized():
        return None
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted((int(m.group(1)), p) for p in root.iterdir()
                      if (m := _STEP_DIR.match(p.name)) and _is_complete(p))
    for _, path in complete[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
         *, step: int, extra: Any = None, keep_last: int | None = None,
         async_save: bool = False) -> Path | AsyncSave:
    """Save ``model`` and ``optimizer`` as ``<path>/step_<step>``; call it on every rank.

    Args:
        path: the directory of checkpoints (created if needed; the same path on every rank,
            on a file system every rank sees).
        model: the model (``fully_shard``-wrapped or plain).
        optimizer: its optimizer, or ``None`` to save the model alone.
        step: the training step; names the directory and is returned by :func:`load`.
        extra: anything JSON-serialisable to keep with the checkpoint (data-loader position,
            scheduler state, ...), returned by :func:`load`.
        keep_last: after the rename, delete all but the newest ``keep_last`` complete
            checkpoints (``None``: keep all).
        async_save: copy each rank's runs (no communication), then write them with
            ``dcp.save`` in a background thread over a gloo group of its own, and return an
            :class:`AsyncSave` at once: training may go on and change the parameters.

    Returns:
        The checkpoint's final directory, or an :class:`AsyncSave` whose ``result()`` returns
        it.

    Raises:
        ValueError: for a negative ``step``, ``keep_last < 1`` or an ``extra`` that is not
            JSON-serialisable (on every rank).
        FileExistsError: if ``<path>/step_<step>`` already exists (nothing is overwritten).
        TypeError: for a ``path``, ``model`` or ``optimizer`` of the wrong type (before
            anything is written).
    """
    _check_arguments("save", path, model, optimizer)
    root = Path(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise_on_any_rank(ValueError(f"save: step must be an int >= 0, got {step!r}"))
    final, tmp = step_dir(root, step), root / f"{_TMP_PREFIX}step_{step:09d}"
    error: BaseException | None = None
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        error = ValueError(f"save: keep_last must be an int >= 1 or None, got {keep_last!r}")
    elif final.exists():
        error = FileExistsError(f"save: checkpoint {final} already exists")
    else:
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            error = ValueError(f"save: extra must be JSON-serialisable: {exc}")
    if error is None and _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this step
            tmp.mkdir()
        except OSError as exc:
            error = exc
    raise_on_any_rank(error)
    state = _state(model, optimizer)
    info = {"step": step, "world_size": _world_size(), "plan_fingerprints":
            plan_fingerprints(model), "versions": _versions(), "extra": extra}

    def finish() -> Path:
        failure: BaseException | None = None
        if _rank() == 0:
            try:
                (tmp / METADATA_FILE).write_text(json.dumps(info, indent=1))
            except OSError as exc:
                failure = exc
        raise_on_any_rank(failure)  # also the barrier: every rank has finished writing
        if _rank() == 0:
            os.replace(tmp, final)
            if keep_last is not None:
                _prune(root, keep_last)
        _barrier()
        return final

    if async_save:
        staged, group = _staged(state), _checkpoint_group()
        upload = _writer().submit(dcp.save, staged, checkpoint_id=tmp, process_group=group)
        return AsyncSave(upload, finish)
    raise_on_any_rank(_local_error("dcp.save", dcp.save, state, checkpoint_id=tmp))
    return finish()


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    """The recorded metadata of the checkpoint at ``path`` (a checkpoint directory).

    Raises:
        TypeError: if ``path`` is not a str or ``os.PathLike``.
        FileNotFoundError: if ``path`` is not a complete checkpoint directory.
    """
    _check_path(path, "read_info")
    path = Path(path)
    if not _is_complete(path):
        raise FileNotFoundError(
            f"{path} is not an fsdp checkpoint (no {METADATA_FILE} and {DCP_METADATA_FILE}); "
            f"unfinished saves live in {_TMP_PREFIX}* directories and are never loaded")
    data = json.loads((path / METADATA_FILE).read_text())
    return CheckpointInfo(path, data["step"], data["world_size"], data["plan_fingerprints"],
                          data["versions"], data["extra"])


def _resolve(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under it."""
    if _is_complete(path):
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(
            f"{path} is neither an fsdp checkpoint nor a directory holding one "
            f"(step_* directories with {METADATA_FILE} and {DCP_METADATA_FILE})")
    return found


def _check_files(path: Path, meta: Metadata) -> None:
    """Every storage file DCP's metadata names exists and is long enough."""
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(f"checkpoint {path} is truncated: {name} is missing")
        if file.stat().st_size < size:
            raise ValueError(f"checkpoint {path} is truncated: {name} has "
                             f"{file.stat().st_size} bytes, its metadata needs {size}")


def _check_model(path: Path, meta: Metadata, state: dict[str, Any]) -> None:
    """The model's tensors are in the checkpoint with the same global shapes."""
    saved = meta.state_dict_metadata
    for key, value in state["model"].items():
        if not isinstance(value, torch.Tensor):
            continue
        entry = saved.get(f"model.{key}")
        if not isinstance(entry, TensorStorageMetadata):
            raise KeyError(f"checkpoint {path} was saved from another model: it has no "
                           f"tensor for the model's {key!r}")
        if tuple(entry.size) != tuple(value.shape):
            raise ValueError(f"checkpoint {path} was saved from another model: {key!r} has "
                             f"shape {tuple(entry.size)} there, {tuple(value.shape)} here")
    model_keys = {f"model.{k}" for k in state["model"]}
    unknown = sorted(k for k in saved if k.startswith("model.") and k not in model_keys)
    if unknown:
        raise KeyError(f"checkpoint {path} was saved from another model: the model has no "
                       f"{unknown[0][len('model.'):]!r}")
    if "optim" in state and not any(k.startswith("optim.") for k in saved):
        raise KeyError(f"checkpoint {path} holds no optimizer state; pass optimizer=None")


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> tuple[int, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) in place; call it on every rank.

    The model may be sharded with another world size or unit policy than the one that saved,
    or be a plain module in one process: each rank reads the boxes covering its own runs.

    Args:
        path: a checkpoint directory, or a directory of them (the newest complete one is
            loaded; unfinished ``.tmp-`` directories are ignored).
        model: the model to fill.
        optimizer: its optimizer (``None``: load the model only).

    Returns:
        ``(step, extra)`` as given to :func:`save`.

    Raises:
        TypeError: for a ``path``, ``model`` or ``optimizer`` of the wrong type.
        FileNotFoundError: if ``path`` holds no complete checkpoint, or a file of it is
            missing (truncated).
        KeyError, ValueError: if the checkpoint was saved from another model (a parameter
            missing, unknown or of another shape) or holds no optimizer state. Every error is
            raised on every rank, before anything is loaded.
    """
    _check_arguments("load", path, model, optimizer)
    error: BaseException | None = None
    state = _state(model, optimizer)
    try:
        found = _resolve(Path(path))
        meta = dcp.FileSystemReader(found).read_metadata()
        _check_files(found, meta)
        _check_model(found, meta, state)
        info = read_info(found)
    except (OSError, KeyError, ValueError) as exc:
        error = exc
    raise_on_any_rank(error)
    with collective_guard("dcp.load", None):
        dcp.load(state, checkpoint_id=found)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return info.step, info.extra
