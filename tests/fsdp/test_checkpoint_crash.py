"""A rank SIGKILLed in the middle of ``fsdp.checkpoint.save`` loses nothing already saved.

Three fresh gloo ranks (:func:`tests.fsdp.test_failures.spawn_world`, with hard limits) save
step 1, then start saving step 2; inside DCP's write, after the other ranks have written their
files, rank 1 kills itself with SIGKILL. Then:

* the other ranks exit within the detection limit (no hang) with a ``PeerFailureError``
  naming rank 1 as the rank that stopped answering;
* step 2 never appears under its final name, only as a ``.tmp-`` directory, which ``latest``
  ignores;
* step 1 loads (at another world size) with exactly the weights it was saved with.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.fsdp.test_checkpoint_io import _full_params, _trained, load_weights
from tests.fsdp.test_failures import DETECT_LIMIT_S, spawn_world

VICTIM = 1


def save_then_die_mid_save(root: str, weights_file: str) -> None:
    import torch.distributed.checkpoint as dcp

    from fsdp import checkpoint

    model = _trained("fsdp")
    checkpoint.save(root, model, None, step=1)
    weights = _full_params(model)
    if dist.get_rank() == 0:
        torch.save(weights, weights_file)
    if dist.get_rank() == VICTIM:
        write_data = dcp.FileSystemWriter.write_data

        def die_while_writing(self, plan, planner):  # noqa: ANN001, ANN202 - torch's signature
            time.sleep(1.0)  # the other ranks write their files meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
            return write_data(self, plan, planner)

        dcp.FileSystemWriter.write_data = die_while_writing
    checkpoint.save(root, model, None, step=2)


def test_sigkill_during_save_keeps_previous_checkpoint(ranks, tmp_path: Path) -> None:
    from fsdp import checkpoint

    root, weights_file = tmp_path / "ckpt", tmp_path / "weights.pt"
    started = time.time()
    outcomes = spawn_world(3, save_then_die_mid_save, str(root), str(weights_file))
    assert outcomes[VICTIM].kind == "died" and outcomes[VICTIM].exitcode == -signal.SIGKILL
    for rank in (0, 2):
        assert outcomes[rank].kind == "err", (rank, outcomes[rank])
        assert outcomes[rank].payload.startswith("PeerFailureError"), outcomes[rank].payload
        assert f"rank(s) [{VICTIM}] did not answer" in outcomes[rank].payload, outcomes[rank]
        assert outcomes[rank].at - started < DETECT_LIMIT_S + 30, rank  # + spawn and step 1
    names = sorted(p.name for p in root.iterdir())
    assert names == [".tmp-step_000000002", "step_000000001"], names
    assert checkpoint.latest(root) == root / "step_000000001"
    loaded = ranks.run(2, load_weights, "fsdp", str(root))[0]
    torch.testing.assert_close(loaded, torch.load(weights_file), rtol=0, atol=0)
