"""pytest plugin loaded by the conformance runner for both implementations alike.

Two test-harness adjustments, no FSDP behaviour: names newer PyTorch test files import that
torch 2.13's test utilities lack (the test files may be a few commits newer than the
installed torch), and, with ``--ungate``, the accelerator gate lifted so CPU runs them.
"""

import enum
import os

import torch.testing._internal.common_utils as common_utils


class HardwareClassification(enum.Enum):
    """Stand-in for the test-selection tag newer ``common_utils`` defines."""

    GENERIC = "generic"


if not hasattr(common_utils, "HardwareClassification"):
    common_utils.HardwareClassification = HardwareClassification


def _allow_cpu(gate):
    """``skip_if_lt_x_gpu(n)`` as if every test passed ``allow_cpu=True``."""

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        del allow_cpu
        return gate(x, allow_cpu=True)

    return skip_if_lt_x_gpu


if os.environ.get("FSDP2_CONFORMANCE_UNGATE") == "1":
    # ``--ungate``: run the accelerator-gated tests on CPU too. Test modules import the
    # decorator by name after this plugin loads, so they get this one; which of them are
    # CPU-capable is then decided by the baseline run on torch's own FSDP2. Applies to
    # in-process (FSDPTestMultiThread) tests; spawned ranks do not load pytest plugins.
    import torch.testing._internal.common_distributed as common_distributed

    common_distributed.skip_if_lt_x_gpu = _allow_cpu(common_distributed.skip_if_lt_x_gpu)
