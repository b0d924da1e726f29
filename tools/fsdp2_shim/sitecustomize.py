"""Set up every interpreter of a conformance run: the pytest process and each rank it spawns.

``tools/fsdp2_conformance.py`` puts this directory first on ``PYTHONPATH``, so Python imports
this module at start-up everywhere, spawned ranks included (they load no pytest plugin).
It does two things, both through an import hook, so nothing heavy is imported at start-up:

* With ``FSDP2_CONFORMANCE_IMPL=fsdp``, once ``torch.distributed.fsdp`` is imported, its
  public names (and those of the legacy ``torch.distributed._composable.fsdp``) are rebound to
  fsdp's, so ``from torch.distributed.fsdp import fully_shard`` inside PyTorch's tests gets
  ours. Nothing else is swapped: the policies are torch's own classes in both, and private
  modules (``torch.distributed.fsdp._fully_shard.*``) stay torch's.
* Test-harness adjustments, the same for both implementations, so PyTorch's accelerator-gated
  tests run on CPU/gloo (``--ungate``): ``skip_if_lt_x_gpu(n)`` behaves as if every test
  passed ``allow_cpu=True``, and without an accelerator ``torch.accelerator.device_count()``
  and ``torch.cpu.device_count()`` report ``FSDP2_CONFORMANCE_CPU_DEVICES`` (default 8), which
  is what ``FSDPTest`` compares with its world size before running a rank. Which tests are
  CPU-capable is then decided by the baseline run on torch's own FSDP2. Also always: names
  that the (slightly newer) test files import and torch 2.13's ``common_utils`` lacks are
  stubbed.
"""

import enum
import importlib.abc
import importlib.machinery
import os
import sys

SWAPPED_NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
                 "share_comm_ctx")
IMPL = os.environ.get("FSDP2_CONFORMANCE_IMPL", "torch")
UNGATE = os.environ.get("FSDP2_CONFORMANCE_UNGATE") == "1"
CPU_DEVICES = int(os.environ.get("FSDP2_CONFORMANCE_CPU_DEVICES", "8"))


class HardwareClassification(enum.Enum):
    """Stand-in for the test-selection tag newer ``common_utils`` defines."""

    GENERIC = "generic"
    ACCELERATOR = "accelerator"


def _swap_fsdp(module) -> None:
    import importlib

    import fsdp

    # The legacy paths re-export the same names: rebind them too (the submodule first,
    # since the package's ``fully_shard`` attribute is about to become the function).
    legacy_module = importlib.import_module("torch.distributed._composable.fsdp.fully_shard")
    legacy_package = importlib.import_module("torch.distributed._composable.fsdp")
    for name in SWAPPED_NAMES:
        for target in (module, legacy_module, legacy_package):
            if target is module or hasattr(target, name):
                setattr(target, name, getattr(fsdp, name))


def _stub_common_utils(module) -> None:
    if not hasattr(module, "HardwareClassification"):
        module.HardwareClassification = HardwareClassification


def _allow_cpu(module) -> None:
    """``skip_if_lt_x_gpu(n)`` as if every test passed ``allow_cpu=True``; patched before
    any test module imports the decorator by name."""
    gate = module.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        del allow_cpu
        return gate(x, allow_cpu=True)

    module.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _cpu_device_count(module) -> None:
    """Without an accelerator, report ``CPU_DEVICES`` devices (``FSDPTest`` skips every rank
    when the accelerator's count is below its world size)."""
    del module
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return
    torch.accelerator.device_count = lambda: CPU_DEVICES
    torch.cpu.device_count = lambda: CPU_DEVICES


PATCHES = {"torch.testing._internal.common_utils": [_stub_common_utils]}
if IMPL == "fsdp":
    PATCHES["torch.distributed.fsdp"] = [_swap_fsdp]
if UNGATE:
    PATCHES["torch.testing._internal.common_distributed"] = [_allow_cpu]
    PATCHES["torch.testing._internal.common_fsdp"] = [_cpu_device_count]


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``PATCHES[name]`` on a module right after it is executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            for patch in PATCHES[name]:
                patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
