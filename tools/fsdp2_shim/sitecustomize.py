"""Resolve FSDP2's public names to fsdp's in every interpreter of a conformance run.

``tools/fsdp2_conformance.py`` puts this directory first on ``PYTHONPATH``, so Python imports
this module at start-up in the pytest process and in every rank process the tests spawn.
With ``FSDP2_CONFORMANCE_IMPL=fsdp`` it rebinds the public names of
``torch.distributed.fsdp`` (and of the legacy ``torch.distributed._composable.fsdp``) to
fsdp's, so ``from torch.distributed.fsdp import fully_shard`` inside PyTorch's tests gets
ours. Nothing else is swapped: the policies are torch's own classes in both, and private
modules (``torch.distributed.fsdp._fully_shard.*``) stay torch's, which is why the tests
that reach into them are listed as excluded.
"""

import os

SWAPPED_NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method")

if os.environ.get("FSDP2_CONFORMANCE_IMPL") == "fsdp":
    import torch.distributed._composable.fsdp as legacy_fsdp
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    for _name in SWAPPED_NAMES:
        setattr(torch_fsdp, _name, getattr(fsdp, _name))
        if hasattr(legacy_fsdp, _name):
            setattr(legacy_fsdp, _name, getattr(fsdp, _name))
