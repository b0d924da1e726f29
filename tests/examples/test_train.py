"""The main job (``hatch run train``) on two gloo ranks: it trains, reports, checkpoints and
resumes, and every optimizer option runs.

The training function runs on the persistent rank pool (``examples.train.main.train`` on an
initialised process group); one test runs the command itself, which spawns its own ranks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from examples.train.config import OPTIMIZERS, TrainConfig, parse_args
from examples.train.main import train

ROOT = Path(__file__).resolve().parents[2]
TINY = TrainConfig(steps=40, batch_size=4, seq_len=32, dim=32, n_layers=2, n_heads=2, ffn_dim=64,
                   lr=1e-2, warmup=4, max_bytes=200_000, val_every=20, val_windows=8,
                   checkpoint_every=0, sample_bytes=16)
"""Small enough for a few seconds a run on two loaded cores, big enough to learn bytes."""
TIMEOUT_S = 240.0


def tiny(tmp_path: Path, **changes: object) -> TrainConfig:
    return dataclasses.replace(TINY, out=str(tmp_path), **changes)


def test_loss_falls_and_report_is_written(ranks, tmp_path: Path) -> None:
    results = ranks.run(2, train, tiny(tmp_path), timeout=TIMEOUT_S)
    assert results[0]["history"] == results[1]["history"]  # global means, the same everywhere
    train_losses = [loss for _, loss in results[0]["history"]["train"]]
    assert len(train_losses) == TINY.steps
    first, last = sum(train_losses[:5]) / 5, sum(train_losses[-5:]) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)  # from ~ln(256) to well below
    val = results[0]["history"]["val"]
    assert [step for step, _ in val] == [0, 20, 40] and val[-1][1] < val[0][1] - 1.5, val
    plot = Path(results[0]["plot"])
    assert plot == tmp_path / "loss.png" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results[1]["plot"] is None
    assert len(results[0]["sample"]) > 0 and results[0]["sample"] == results[1]["sample"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_runs_two_steps(ranks, tmp_path: Path, optimizer: str) -> None:
    config = tiny(tmp_path, optimizer=optimizer, steps=2, val_every=2, sample_bytes=0)
    results = ranks.run(2, train, config, timeout=TIMEOUT_S)
    losses = [loss for _, loss in results[0]["history"]["train"]]
    assert len(losses) == 2 and all(4.0 < loss < 7.0 for loss in losses), losses


def test_bf16_runs_two_steps(ranks, tmp_path: Path) -> None:
    config = tiny(tmp_path, mixed_precision="bf16", steps=2, val_every=2, sample_bytes=0)
    losses = [loss for _, loss in ranks.run(2, train, config, timeout=TIMEOUT_S)[0]["history"]["train"]]
    assert len(losses) == 2 and all(4.0 < loss < 7.0 for loss in losses), losses


def test_fp8_all_gather_runs_two_steps(ranks, tmp_path: Path) -> None:
    config = parse_args(["--fp8", "--mixed-precision", "bf16", "--steps", "2"])
    assert config.fp8
    config = tiny(tmp_path, mixed_precision="bf16", fp8=True, steps=2, val_every=2, sample_bytes=0)
    losses = [loss for _, loss in ranks.run(2, train, config, timeout=TIMEOUT_S)[0]["history"]["train"]]
    assert len(losses) == 2 and all(4.0 < loss < 7.0 for loss in losses), losses


def test_resume_continues_exactly(ranks, tmp_path: Path) -> None:
    """Resuming at step 3 of 6 gives the uninterrupted run's losses bit for bit (the batches
    depend only on the step; model and optimizer state come back from the checkpoint)."""
    whole = tiny(tmp_path / "whole", steps=6, checkpoint_every=3, val_every=3, sample_bytes=0)
    expected = ranks.run(2, train, whole, timeout=TIMEOUT_S)[0]["history"]
    checkpoints = tmp_path / "whole" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000000003", "step_000000006"]

    shutil.copytree(checkpoints / "step_000000003", tmp_path / "resumed" / "checkpoints" / "step_000000003")
    resumed = dataclasses.replace(whole, out=str(tmp_path / "resumed"), resume=True)
    results = ranks.run(2, train, resumed, timeout=TIMEOUT_S)
    assert results[0]["start_step"] == 3
    assert results[0]["history"] == expected


def test_config_file_and_flags(tmp_path: Path) -> None:
    """Defaults, then the TOML file, then the flags."""
    path = tmp_path / "run.toml"
    path.write_text('optimizer = "muon"\nsteps = 7\nmixed-precision = "bf16"\n')
    config = parse_args(["--config", str(path), "--steps", "9", "--resume"])
    assert (config.optimizer, config.steps, config.mixed_precision, config.resume) == ("muon", 9, "bf16", True)
    assert config.world_size == TrainConfig().world_size
    path.write_text("stepz = 3\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "sgd"])


def test_command_spawns_its_ranks(tmp_path: Path) -> None:
    """``python -m examples.train`` (what ``hatch run train`` runs) spawns two gloo ranks,
    prints the run's summary, and writes the plot."""
    flags = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dim", "16", "--n-layers", "1",
             "--n-heads", "2", "--ffn-dim", "32", "--max-bytes", "50000", "--val-every", "2",
             "--val-windows", "2", "--checkpoint-every", "0", "--sample-bytes", "4", "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "examples.train", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fsdp main job: 2 ranks (gloo, cpu)" in done.stdout, done.stdout
    assert "held-out loss:" in done.stdout and "sample (prompt 'def '):" in done.stdout
    assert (tmp_path / "loss.png").is_file()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "muon", "shampoo"])
def test_tensor_parallel_trains_like_data_parallel_only(ranks, tmp_path: Path,
                                                         optimizer: str) -> None:
    """``--tp 2`` on four ranks (dp 2 x tp 2) sees the same global batch as two ranks without
    TP (each dp rank's slice is shared by its tp ranks): the losses agree to float noise, with
    every optimizer of the job (the block optimizers step TP-sharded weights whole)."""
    steps = dict(steps=4, val_every=4, sample_bytes=8, optimizer=optimizer)
    plain = ranks.run(2, train, tiny(tmp_path / "dp", **steps), timeout=TIMEOUT_S)[0]
    tp = ranks.run(4, train, tiny(tmp_path / "tp", tp=2, **steps), timeout=TIMEOUT_S)
    assert all(r["history"] == tp[0]["history"] for r in tp)  # every rank reports the same
    for key in ("train", "val"):
        for (step, a), (step_tp, b) in zip(plain["history"][key], tp[0]["history"][key]):
            assert step == step_tp and abs(a - b) < 1e-4, (key, step, a, b)
    assert len(tp[0]["sample"]) > 0


def test_tensor_parallel_options_are_checked() -> None:
    with pytest.raises(ValueError, match="tp=3 must be >= 1 and divide n_heads=4"):
        TrainConfig(tp=3)
    with pytest.raises(ValueError, match="tp=2 runs without fp8"):
        TrainConfig(tp=2, fp8=True)
