"""Import fsdp at interpreter start in every process of a ``tools/dtensor_suite.py`` run.

``tools/dtensor_suite.py`` puts this directory first on ``PYTHONPATH``, so Python imports this
module at start-up in the pytest process and in every rank process PyTorch's tests spawn.
``DTENSOR_SUITE_MODE`` says what a user of this project would have done before torch's code
runs: ``plain`` nothing, ``fsdp`` ``import fsdp``, ``installed`` ``import fsdp`` and
``ragged_dtensor.install()`` (what the first RaggedShard does), so that every row of
``ragged_dtensor.torch_patches.PATCHES`` is in place while torch's tests run.
"""

import os

if os.environ.get("DTENSOR_SUITE_UNGATE") == "1":
    # ``--ungate`` (every mode alike, a harness adjustment): accelerator-gated tests run on
    # CPU, and the CPU device module reports enough devices for their world sizes (the copies
    # ask it where the originals ask torch.cuda.device_count()). tools/fsdp2_shim's
    # sitecustomize (shadowed by this module's name, so loaded from its file) lifts
    # skip_if_lt_x_gpu in every process; a failure here must not pass silently, since Python
    # would then run the process without this module and so without ``import fsdp``.
    import importlib.util
    from pathlib import Path

    import torch

    _DEVICES = int(os.environ.get("DTENSOR_SUITE_CPU_DEVICES", "4"))
    os.environ["FSDP2_CONFORMANCE_UNGATE"] = "1"
    os.environ["FSDP2_CONFORMANCE_CPU_DEVICES"] = str(_DEVICES)
    _spec = importlib.util.spec_from_file_location(
        "fsdp2_shim_sitecustomize",
        Path(__file__).resolve().parents[1] / "fsdp2_shim" / "sitecustomize.py",
    )
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

    torch.cpu.device_count = lambda: _DEVICES

_MODE = os.environ.get("DTENSOR_SUITE_MODE", "plain")

if _MODE in ("fsdp", "installed"):
    import fsdp  # noqa: F401 - the import under test

    if _MODE == "installed":
        import ragged_dtensor

        ragged_dtensor.install()
