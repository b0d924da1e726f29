"""``benchmarks/torch_211_shim.py``, which lets the GPU benchmarks run fsdp on the lent image's
torch 2.11, checked on this machine's torch 2.13.

On 2.13 it refuses and changes nothing. Then torch 2.11 is imitated in a child process (the
version string, a ``_FromTorchTensor.forward`` that takes 2.11's seven parameters, reached
only through ragged_dtensor's replacement once that is installed): the shim
must let ragged_dtensor install there, fsdp must train as FSDP2 does (the same losses on one
gloo rank), and its storage-swap stand-in must refuse a swap that would move memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmark_modules import BENCHMARKS, load_benchmark


def test_refuses_another_torch_and_changes_nothing() -> None:
    from ragged_dtensor import autograd_hooks, torch_patches

    shim = load_benchmark("torch_211_shim")
    before = (torch_patches.PATCHES, autograd_hooks._ORIGINAL_FORWARD,
              torch.UntypedStorage.__dict__.get("_swap_data_ptr_"))
    with pytest.raises(RuntimeError, match=r"for torch 2\.11, this is 2\.13"):
        shim.install()
    assert before == (torch_patches.PATCHES, autograd_hooks._ORIGINAL_FORWARD,
                      torch.UntypedStorage.__dict__.get("_swap_data_ptr_"))


IMITATED_211 = """
import torch
import torch.distributed as dist
import torch.distributed.tensor._api as api

real = api._FromTorchTensor.forward
def forward_211(ctx, input, device_mesh, placements, run_check, shape=None, stride=None):
    return real(ctx, input, device_mesh, placements, run_check, shape, stride, None)
api._FromTorchTensor.forward = staticmethod(forward_211)
torch.__version__ = "2.11.0+imitated"

import torch_211_shim
from ragged_dtensor import torch_patches
import fsdp
from torch.distributed import fsdp as fsdp2
from torch.distributed.device_mesh import init_device_mesh
from train_step import Llama, ModelConfig, _loss

try:
    torch_patches.install()
except torch_patches.TorchPatchError:
    pass
else:
    raise AssertionError("the imitated 2.11 should be refused without the shim")
torch_211_shim.install()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cfg = ModelConfig(layers=2, dim=64, heads=4, ffn=128, vocab=100, seq=16, batch_per_rank=2)
tokens = torch.randint(cfg.vocab, (2, cfg.seq + 1), generator=torch.Generator().manual_seed(1))
losses = {}
for name, api_ in (("fsdp", fsdp), ("fsdp2", fsdp2)):
    torch.manual_seed(0)
    model = Llama(cfg)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        api_.fully_shard(layer, mesh=mesh)
    api_.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses[name] = []
    for _ in range(3):
        loss = _loss(model, tokens, cfg.vocab)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[name].append(loss.item())
assert torch_patches.installed()
from torch.distributed.tensor import DTensor, Replicate
# from_local reaches 2.11's forward through ragged_dtensor's replacement, with seven arguments
assert DTensor.from_local(torch.arange(4.0), mesh, [Replicate()]).full_tensor().tolist() == [0, 1, 2, 3]
assert losses["fsdp"] == losses["fsdp2"], losses
try:
    torch.empty(4).untyped_storage()._swap_data_ptr_(torch.empty(4).untyped_storage())
except NotImplementedError:
    pass
else:
    raise AssertionError("a swap that moves memory must raise")
dist.destroy_process_group()
print("ok", losses["fsdp"])
"""


def test_lets_fsdp_train_as_fsdp2_on_an_imitated_torch_211(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, str(BENCHMARKS)])}
    script = tmp_path / "imitated_211.py"
    script.write_text(IMITATED_211)
    done = subprocess.run([sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout
