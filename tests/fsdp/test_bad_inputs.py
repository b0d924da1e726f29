"""Bad-input table for fsdp's public entry points (issue 10): one row per invalid input.

Each case runs on a world-size-1 gloo rank and asserts the exception type and a message naming
the argument at fault; the checkpoint cases also check that the checkpoint saved before them is
still there, whole and loadable (nothing already saved is lost). Not repeated here (see
tests/fsdp/test_behaviour.py::test_bad_inputs_raise_clear_errors_on_every_rank, world size 2):
parameters shared across groups, top-down wrapping, mixed meta devices, shapes differing across
ranks, a 0-D parameter, ModuleList, unit_policy returning 0, an uneven Shard(1), an int
reshard_after_forward, a set_custom_all_gather comm without the interface, an empty parameter. Nor the checkpoint cases of
tests/fsdp/test_checkpoint_io.py (world size 2, on every rank): an empty directory (not a
checkpoint), a truncated checkpoint, a checkpoint of another model, a negative or non-int step,
keep_last 0, a non-JSON extra, an existing step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate

from tests.bad_inputs import assert_names_fault, raised_by
from tests.harness import device_mesh


def _linear() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


def _wrapped() -> Any:
    import fsdp

    return fsdp.fully_shard(_linear(), mesh=device_mesh(1))


def _shard(**kwargs: Any) -> Callable[[Path], object]:
    def call(root: Path) -> object:
        import fsdp

        return fsdp.fully_shard(kwargs.pop("module", _linear()), **{"mesh": device_mesh(1), **kwargs})
    return call


def _twice(root: Path) -> None:
    model = _wrapped()
    import fsdp

    fsdp.fully_shard(model, mesh=device_mesh(1))


def _int_policy(root: Path) -> object:
    import fsdp

    return _shard(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.int32))(root)


def _setter(method: str, *args: Any) -> Callable[[Path], object]:
    return lambda root: getattr(_wrapped(), method)(*args)


def _forward_method(root: Path) -> None:
    import fsdp

    fsdp.register_fsdp_forward_method(_wrapped(), "generate")


def _in_backward(module: Callable[[], Any], optimizer: Callable[[Any], Any]) -> Callable[[Path], object]:
    def call(root: Path) -> object:
        import fsdp

        model = module()
        return fsdp.optimizer_in_backward(model, optimizer(model))
    return call


def _ckpt(call: Callable[[Any, Path], object]) -> Callable[[Path], object]:
    def run(root: Path) -> object:
        from fsdp import checkpoint

        return call(checkpoint, root)
    return run


def _load_with_sgd(checkpoint: Any, root: Path) -> object:
    model = _wrapped()
    return checkpoint.load(root, model, torch.optim.SGD(model.parameters(), lr=0.1))


CASES: dict[str, tuple[Callable[[Path], object], type[BaseException], str]] = {
    "fully_shard-module-tensor": (_shard(module=torch.ones(3)), TypeError, r"expects an nn.Module .* got Tensor"),
    "fully_shard-module-empty-list": (_shard(module=[]), TypeError, r"non-empty list of them, got list"),
    "fully_shard-mesh-str": (_shard(mesh="cpu"), TypeError, r"mesh must be a DeviceMesh or None, got str"),
    "fully_shard-mesh-3d": (lambda root: _shard(mesh=device_mesh(1, 1, 1))(root), ValueError, r"expects a 1D or 2D DeviceMesh"),
    "fully_shard-mp_policy-dict": (_shard(mp_policy={"param_dtype": torch.bfloat16}), TypeError,
                                   r"mp_policy must be a MixedPrecisionPolicy, got dict"),
    "fully_shard-mp_policy-int32": (_int_policy, TypeError, r"compute_dtype: dtype torch.int32 is not supported"),
    "fully_shard-unit_policy-str": (_shard(unit_policy="rows"), TypeError, r"unit_policy must be callable"),
    "fully_shard-unit_policy-float": (_shard(unit_policy=lambda name, p: 1.5), ValueError,
                                      r"unit_policy returned 1.5 for parameter '0.weight'"),
    "fully_shard-shard_placement_fn-Replicate": (_shard(shard_placement_fn=lambda p: Replicate()),
                                                 NotImplementedError, r"shard_placement_fn returned Replicate\(\)"),
    "fully_shard-reshard_after_forward-str": (_shard(reshard_after_forward="yes"), ValueError,
                                              r"reshard_after_forward should be a bool or an int .*, not 'yes'"),
    "fully_shard-module-twice": (_twice, AssertionError, r"fully_shard was already applied to FSDPSequential"),
    "set_reshard_after_forward-str": (_setter("set_reshard_after_forward", "yes"), ValueError,
                                      r"reshard_after_forward should be a bool"),
    "set_gradient_divide_factor-str": (_setter("set_gradient_divide_factor", "x"), ValueError,
                                       r"set_gradient_divide_factor: factor must be a number, got 'x'"),
    "set_modules_to_forward_prefetch-plain-module": (_setter("set_modules_to_forward_prefetch", [nn.Linear(2, 2)]),
                                                     ValueError, r"expected a module fully_shard was applied to"),
    "set_modules_to_backward_prefetch-int": (_setter("set_modules_to_backward_prefetch", 3), TypeError,
                                             r"modules must be a list of modules .*, got int"),
    "set_custom_reduce_scatter-str": (_setter("set_custom_reduce_scatter", "nccl"), TypeError,
                                      r"set_custom_reduce_scatter: comm must be None or a callable .*, got str"),
    "set_symm_mem_for_comm": (_setter("set_symm_mem_for_comm", "NCCL"), NotImplementedError,
                              r"set_symm_mem_for_comm: not a switch in fsdp; pass set_custom_all_gather"),
    "register_fsdp_forward_method-unknown": (_forward_method, ValueError, r"has no method 'generate'"),
    "optimizer_in_backward-plain-module": (_in_backward(_linear, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
                                           TypeError, r"Sequential is not a module fully_shard was applied to"),
    "optimizer_in_backward-not-optimizer": (_in_backward(_wrapped, lambda m: "adam"), TypeError,
                                            r"optimizer must be a torch.optim.Optimizer, got str"),
    "optimizer_in_backward-missing-params": (_in_backward(_wrapped, lambda m: torch.optim.SGD(
        [next(m.parameters())], lr=0.1)), ValueError, r"parameters \['0.bias'\] of .* are not in the optimizer"),
    "optimizer_in_backward-foreign-params": (_in_backward(_wrapped, lambda m: torch.optim.SGD(
        [*m.parameters(), torch.nn.Parameter(torch.ones(2))], lr=0.1)), ValueError,
        r"holds 1 parameter\(s\) that no fully_shard group"),
    "checkpoint.load-path-missing": (_ckpt(lambda c, root: c.load(root / "nope", _wrapped())), FileNotFoundError,
                                     r"nope is neither an fsdp checkpoint"),
    "checkpoint.load-path-a-file": (_ckpt(lambda c, root: c.load(root / "step_000000001" / ".metadata", _wrapped())),
                                    FileNotFoundError, r"\.metadata is neither an fsdp checkpoint"),
    "checkpoint.read_info-path-a-root": (_ckpt(lambda c, root: c.read_info(root)), FileNotFoundError,
                                         r"is not an fsdp checkpoint"),
    "checkpoint.read_info-path-int": (_ckpt(lambda c, root: c.read_info(3)), TypeError,
                                      r"read_info: path must be a str or os.PathLike, got int"),
    "checkpoint.load-optimizer-not-saved": (_ckpt(_load_with_sgd), KeyError, r"holds no optimizer state"),
    "checkpoint.load-path-int": (_ckpt(lambda c, root: c.load(3, _wrapped())), TypeError,
                                 r"path must be a str or os.PathLike, got int"),
    "checkpoint.save-path-none": (_ckpt(lambda c, root: c.save(None, _wrapped(), None, step=2)), TypeError,
                                  r"path must be a str or os.PathLike, got NoneType"),
    "checkpoint.load-model-str": (_ckpt(lambda c, root: c.load(root, "model")), TypeError,
                                  r"model must be an nn.Module, got str"),
    "checkpoint.save-model-str": (_ckpt(lambda c, root: c.save(root, "model", None, step=2)), TypeError,
                                  r"model must be an nn.Module, got str"),
    "checkpoint.save-optimizer-str": (_ckpt(lambda c, root: c.save(root, _wrapped(), "adam", step=2)), TypeError,
                                      r"optimizer must be a torch.optim.Optimizer or None, got str"),
    "checkpoint.save-keep_last-str": (_ckpt(lambda c, root: c.save(root, _wrapped(), None, step=2, keep_last="2")),
                                      ValueError, r"keep_last must be an int >= 1 or None, got '2'"),
    "checkpoint.save-step-float": (_ckpt(lambda c, root: c.save(root, _wrapped(), None, step=2.0)), ValueError,
                                   r"step must be an int >= 0, got 2.0"),
}


def run_case(case_id: str, root: str) -> dict[str, Any]:
    """Save one checkpoint into ``root``, run the case, then report its error and whether the
    checkpoint is still whole and loadable."""
    from fsdp import checkpoint

    path = Path(root)
    checkpoint.save(path, _wrapped(), None, step=1)
    out: dict[str, Any] = {"raised": raised_by(CASES[case_id][0], path)}
    out["listing"] = sorted(p.name for p in path.iterdir())
    out["loaded_step"] = checkpoint.load(path, _wrapped())[0]
    return out


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input_names_the_argument(ranks: Any, tmp_path: Path, case_id: str) -> None:
    _, error, message = CASES[case_id]
    (out,) = ranks.run(1, run_case, case_id, str(tmp_path / "ckpt"))
    assert_names_fault(case_id, out["raised"], error, message)
    assert out["listing"] == ["step_000000001"], out["listing"]  # nothing saved is lost or added
    assert out["loaded_step"] == 1
