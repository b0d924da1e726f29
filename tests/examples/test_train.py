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


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_fp8_all_gather_runs_two_steps(ranks, tmp_path: Path, experts: int) -> None:
    config = parse_args(["--fp8", "--mixed-precision", "bf16", "--steps", "2"])
    assert config.fp8
    config = tiny(tmp_path, mixed_precision="bf16", fp8=True, steps=2, val_every=2, sample_bytes=0,
                  moe_experts=experts)
    losses = [loss for _, loss in ranks.run(2, train, config, timeout=TIMEOUT_S)[0]["history"]["train"]]
    assert len(losses) == 2 and all(4.0 < loss < 7.0 for loss in losses), losses


@pytest.mark.parametrize(("world", "changes"), [(2, {}), (4, {"moe_experts": 4, "ep": 2})],
                         ids=["dense", "moe-ep2"])
def test_resume_continues_exactly(ranks, tmp_path: Path, world: int,
                                  changes: dict[str, int]) -> None:
    """Resuming at step 3 of 6 gives the uninterrupted run's losses bit for bit (the batches
    depend only on the step; model and optimizer state come back from the checkpoint), also
    with expert parallelism (expert stacks on the ``(dp, ep)`` mesh)."""
    whole = tiny(tmp_path / "whole", steps=6, checkpoint_every=3, val_every=3, sample_bytes=0,
                 **changes)
    expected = ranks.run(world, train, whole, timeout=TIMEOUT_S)[0]["history"]
    checkpoints = tmp_path / "whole" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000000003", "step_000000006"]

    shutil.copytree(checkpoints / "step_000000003", tmp_path / "resumed" / "checkpoints" / "step_000000003")
    resumed = dataclasses.replace(whole, out=str(tmp_path / "resumed"), resume=True)
    results = ranks.run(world, train, resumed, timeout=TIMEOUT_S)
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


def _expert_layout(config: TrainConfig) -> dict[str, object]:
    """The MoE decoder of ``config`` sharded as the job shards it with ``--ep 2`` and with
    ``--ep 1``, one forward/backward on this rank's tokens. Returns, under EP, each expert
    stack's elements held here, whether its placements are (fsdp over dp, ``Shard(0)`` over
    ep) and whether this EP rank's experts are the right whole experts of the unsharded
    model; and how far the EP gradients of the experts are from those without EP."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from examples.train.model import Decoder, ModelConfig
    from examples.train.parallelize import parallelize
    from ragged_dtensor import RaggedShard

    world, names = dist.get_world_size(), ("w1", "w3", "w2")
    shape = ModelConfig(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads,
                        ffn_dim=config.ffn_dim, max_seq_len=config.seq_len,
                        n_experts=config.moe_experts, top_k=config.moe_top_k)
    tokens = torch.randint(0, 256, (2, config.seq_len),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    torch.manual_seed(0)
    reference = Decoder(shape).layers[0].moe.experts
    grads, out = {}, {}
    for ep in (2, 1):
        torch.manual_seed(0)
        model = Decoder(shape)
        expert_mesh = (init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
                       if ep > 1 else None)
        parallelize(model, init_device_mesh("cpu", (world,)), None, None, expert_mesh=expert_mesh)
        experts = model.layers[0].moe.experts
        if expert_mesh is not None:
            stacks = {n: getattr(experts, n) for n in names}
            per_ep = config.moe_experts // ep
            first = expert_mesh["ep"].get_local_rank() * per_ep
            out["held"] = [stacks[n].to_local().numel() for n in names]
            out["placed"] = all(s.device_mesh.mesh_dim_names == ("dp", "ep")
                                and isinstance(s.placements[0], RaggedShard)
                                and s.placements[1] == Shard(0) for s in stacks.values())
            out["whole"] = all(torch.equal(
                stacks[n].detach().redistribute(expert_mesh, (Replicate(), Shard(0))).to_local(),
                getattr(reference, n).detach()[first:first + per_ep]) for n in names)
        model(tokens).float().logsumexp(-1).mean().backward()
        grads[ep] = {n: getattr(experts, n).grad.full_tensor() for n in names}
    out["grad_diff"] = max((grads[2][n] - grads[1][n]).abs().max().item() for n in names)
    out["grad_scale"] = max(g.abs().max().item() for g in grads[1].values())
    return out


def test_expert_parallel_shards_whole_experts(ranks, tmp_path: Path) -> None:
    """``--moe-experts 4 --moe-top-k 2 --ep 2`` on 4 ranks (mesh ``(dp 2, ep 2)``): every
    expert stack is ``Shard(0)`` over ``ep``, each EP rank holds its 2 whole experts, cut over
    its 2 dp ranks at expert boundaries; the experts' gradients equal those of the same model
    without EP (every rank's tokens reach their expert; averaged over all 4 ranks, not the 2
    dp ranks: measured 1.3e-7 of the largest gradient, a divisor of 2 would be off by 100%)."""
    config = tiny(tmp_path, moe_experts=4, moe_top_k=2)
    outs = ranks.run(4, _expert_layout, config, timeout=TIMEOUT_S)
    expert = config.ffn_dim * config.dim
    for out in outs:
        assert out["placed"] and out["whole"], out
        assert out["grad_scale"] > 0 and out["grad_diff"] <= 1e-6 * out["grad_scale"], out
    for dp_pair in ((0, 2), (1, 3)):  # the ranks of one EP rank
        for stack in range(3):
            runs = [outs[r]["held"][stack] for r in dp_pair]
            assert sum(runs) == 2 * expert and all(n % expert == 0 for n in runs), outs


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_expert_parallel_trains_like_experts_on_every_rank(ranks, tmp_path: Path,
                                                           optimizer: str) -> None:
    """``--moe-experts 4 --ep 2`` on four ranks trains like ``--ep 1`` (every rank computes
    every expert) on the same global batch, with every optimizer of the job.

    Measured differences over 4 steps: AdamW 0, AdamW8bit 4.8e-7, Shampoo 9.5e-7 (one or two
    float32 ulps of a loss near 5), Muon 2.8e-5 (its Newton-Schulz iterations run in
    bfloat16, where ulp-level gradient differences flip roundings). A wrong gradient divisor
    for the experts (2 instead of 4) moves AdamW's losses by up to 7e-6, so the bound is 2e-6
    (1e-4 for Muon, as in the TP test).
    """
    bound = 1e-4 if optimizer == "muon" else 2e-6
    steps = dict(steps=4, val_every=4, sample_bytes=8, moe_experts=4, optimizer=optimizer)
    plain = ranks.run(4, train, tiny(tmp_path / "ep1", **steps), timeout=TIMEOUT_S)[0]
    ep = ranks.run(4, train, tiny(tmp_path / "ep2", ep=2, **steps), timeout=TIMEOUT_S)
    assert all(r["history"] == ep[0]["history"] for r in ep)  # every rank reports the same
    for key in ("train", "val"):
        assert len(ep[0]["history"][key]) == len(plain["history"][key]) > 0
        for (step, a), (step_ep, b) in zip(plain["history"][key], ep[0]["history"][key]):
            assert step == step_ep and abs(a - b) <= bound, (key, step, a, b)
    assert len(ep[0]["sample"]) > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_layer_matches_a_loop_over_tokens(top_k: int) -> None:
    """The MoE layer (sorted dispatch, grouped experts, weighted combine) against each token
    sent through its top-k experts one at a time, outputs and router gradients."""
    import torch
    import torch.nn.functional as F

    from examples.train.moe import MoE

    torch.manual_seed(0)
    moe = MoE(dim=8, ffn_dim=12, num_experts=4, top_k=top_k)
    for stack in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
        torch.nn.init.normal_(stack, std=0.3)
    x = torch.randn(2, 5, 8)
    probs = moe.router(x).softmax(-1)
    expected = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            gates, chosen = probs[b, t].topk(top_k)
            for gate, e in zip(gates, chosen.tolist()):
                w1, w3, w2 = (getattr(moe.experts, n)[e] for n in ("w1", "w3", "w2"))
                h = F.silu(w1 @ x[b, t]) * (w3 @ x[b, t])
                expected[b, t] += gate * (w2 @ h)
    got = moe(x)
    assert torch.allclose(got, expected, atol=1e-6), (got - expected).abs().max()
    (grad,) = torch.autograd.grad(got.square().sum(), moe.router.weight)
    (want,) = torch.autograd.grad(expected.square().sum(), moe.router.weight)
    assert grad.abs().max() > 0 and torch.allclose(grad, want, atol=1e-6)


def test_expert_parallel_options_are_checked() -> None:
    with pytest.raises(ValueError, match="--ep 2 needs a mixture of experts"):
        TrainConfig(ep=2)
    with pytest.raises(ValueError, match="--moe-experts 6 must be divisible by --ep 4"):
        TrainConfig(moe_experts=6, ep=4)
    with pytest.raises(ValueError, match="--moe-experts with --tp 2"):
        TrainConfig(moe_experts=4, ep=2, tp=2)
    with pytest.raises(ValueError, match="--ep 2 runs without --fp8"):
        TrainConfig(moe_experts=4, ep=2, fp8=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="--moe-top-k 5 must be in"):
        TrainConfig(moe_experts=4, moe_top_k=5)
    with pytest.raises(SystemExit):
        parse_args(["--ep", "2"])  # argparse reports the ValueError
    config = parse_args(["--moe-experts", "8", "--moe-top-k", "2", "--ep", "4"])
    assert (config.moe_experts, config.moe_top_k, config.ep) == (8, 2, 4)
