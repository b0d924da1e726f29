"""The ring cost model against closed forms, the simulator against hand-computed steps, the CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from layout_planner import Cluster, Link, plan, predict_step
from layout_planner.catalog import get_model
from layout_planner.cli import main
from layout_planner.comm_model import all_gather_time, all_reduce_time, fit_link, reduce_scatter_time
from layout_planner.search import solve
from layout_planner.simulate import format_predictions, sweep
from layout_planner.units import UnitRule
from tests.docs_pages import exec_source, python_blocks

ONE_NODE = Cluster(gpus_per_node=1024, intra=Link(bandwidth=100.0, latency=0.5), inter=Link(1.0, 1.0))
WORLDS = [2**k for k in range(3, 17)]  # 8 .. 65,536


def test_ring_closed_forms_on_one_node() -> None:
    # (m - 1) steps of alpha + chunk / beta; all-reduce: 2 (m - 1) steps of chunk / m.
    assert all_gather_time(ONE_NODE, 4, 10.0) == pytest.approx(3 * (0.5 + 10 / 100))
    assert reduce_scatter_time(ONE_NODE, 3, 50.0) == pytest.approx(2 * (0.5 + 50 / 100))
    assert all_reduce_time(ONE_NODE, 4, 40.0) == pytest.approx(6 * (0.5 + 10 / 100))
    assert all_gather_time(ONE_NODE, 1, 10.0) == 0.0 and all_reduce_time(ONE_NODE, 1, 10.0) == 0.0
    assert Link(100.0, 0.5).step_time(10.0) == pytest.approx(0.6)


def test_ring_across_nodes_by_hand() -> None:
    two_per_node = Cluster(gpus_per_node=2, intra=Link(100.0, 1.0), inter=Link(10.0, 5.0))
    # 4 ranks on 2 nodes: 3 steps, 1 crosses nodes; every step moves its chunk at the NIC's 10 B/s.
    assert all_gather_time(two_per_node, 4, 20.0) == pytest.approx(2 * 1.0 + 1 * 5.0 + 3 * 20 / 10)
    # Replicate group of 3 ranks 2 apart (ranks 0, 2, 4): 3 nodes, 2 (m - 1) = 4 steps, all crossing.
    assert all_reduce_time(two_per_node, 3, 30.0, stride=2) == pytest.approx(4 * 5.0 + 4 * 10 / 10)
    # Inside one node the NIC plays no part.
    assert all_gather_time(two_per_node, 2, 20.0) == pytest.approx(1.0 + 20 / 100)


@pytest.mark.parametrize("gpus_per_node", [1, 3, 8])
def test_nodes_spanned_matches_counting(gpus_per_node: int) -> None:
    cluster = Cluster(gpus_per_node=gpus_per_node)
    for ranks in range(1, 20):
        for stride in range(1, 20):
            brute = len({(i * stride) // gpus_per_node for i in range(ranks)})
            assert cluster.nodes_spanned(ranks, stride) == brute, (ranks, stride)


def test_predict_step_equals_hand_computed_step_on_one_node() -> None:
    model = get_model("llama3-8b")
    got = predict_step(model, 8, cluster=ONE_NODE, param_bytes=2, reduce_bytes=4)
    rule = UnitRule("rows", 1)
    ag = rs = sent = 0.0
    padding = 0
    for group in model.groups:
        p = plan(group.specs(rule), 8, align=4)
        ag += group.count * 2 * 7 * (0.5 + p.shard_size * 2 / 100)  # forward + backward all-gather
        rs += group.count * 7 * (0.5 + p.shard_size * 4 / 100)
        sent += group.count * 7 * p.shard_size * (2 * 2 + 4)
        padding += group.count * p.padding
    assert got.all_gather_seconds == pytest.approx(ag) and got.reduce_scatter_seconds == pytest.approx(rs)
    assert got.all_reduce_seconds == 0 and got.seconds == pytest.approx(ag + rs)
    assert got.bytes_per_rank == pytest.approx(sent)
    assert got.padding_ratio == pytest.approx(padding / model.numel)
    once = predict_step(model, 8, cluster=ONE_NODE, reshard_after_forward=False)
    assert once.all_gather_seconds == pytest.approx(ag / 2)


def test_hsdp_with_one_replica_is_fsdp_and_adds_an_all_reduce() -> None:
    assert predict_step("llama3-70b", 64, 64) == predict_step("llama3-70b", 64)
    fsdp8, hsdp = predict_step("llama3-70b", 8), predict_step("llama3-70b", 64, 8)
    assert hsdp.replicate == 8 and hsdp.groups[1].shard_sizes == fsdp8.groups[1].shard_sizes
    assert hsdp.all_gather_seconds == fsdp8.all_gather_seconds
    cluster = Cluster()
    expected = sum(g.count * all_reduce_time(cluster, 8, g.shard_sizes[0] * 4, stride=8) for g in fsdp8.groups)
    assert hsdp.all_reduce_seconds == pytest.approx(expected) and expected > 0


def test_more_bandwidth_less_time_more_latency_more_time() -> None:
    base = Cluster()
    faster = Cluster(inter=Link(2 * base.inter.bandwidth, base.inter.latency))
    slower = Cluster(intra=Link(base.intra.bandwidth, 2 * base.intra.latency))
    for world, shard in ((1024, None), (1024, 8)):
        t = predict_step("llama3-8b", world, shard, cluster=base).seconds
        assert predict_step("llama3-8b", world, shard, cluster=faster).seconds < t
        assert predict_step("llama3-8b", world, shard, cluster=slower).seconds > t
    # A ring inside one node never touches the NIC.
    assert predict_step("llama3-8b", 8, cluster=faster).seconds == predict_step("llama3-8b", 8).seconds


def test_padding_spike_names_the_forcing_unit() -> None:
    # LLaMA-3-8B at 16,384 ranks: down_proj (rows of 14,336) and the 4,096-row tensors hold
    # whole shards, so S sits on lcm(14336, 4096) = 28,672: double the average load.
    spike = predict_step("llama3-8b", 16384)
    layer = spike.worst_group()
    assert (layer.group, layer.forced_by, layer.forcing_unit, layer.lattice) == (
        "layer", "mlp.down_proj.weight", 14336, 28672)
    assert layer.shard_sizes == (28672,) and spike.unit_padding_ratio > 1.0
    assert predict_step("llama3-8b", 8).unit_padding_ratio < 0.001
    table = format_predictions([spike, predict_step("llama3-8b", 8)])
    assert "layer:mlp.down_proj.weight (14336)" in table.splitlines()[1]
    assert "down_proj" not in table.splitlines()[2]


def test_exposed_seconds() -> None:
    p = predict_step("llama3-8b", 1024)
    assert p.exposed_seconds(0.0) == p.seconds and p.exposed_seconds(p.seconds + 1) == 0.0
    assert p.exposed_seconds(0.25) == pytest.approx(p.seconds - 0.25)
    with pytest.raises(ValueError, match="compute_seconds"):
        p.exposed_seconds(-1.0)


def test_sweep_of_the_largest_catalog_model_to_65536_ranks_is_fast() -> None:
    solve.cache_clear()
    start = time.perf_counter()
    rows = sweep("deepseek-v3", WORLDS, [8, 64, 512])
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0  # about 1 s on a shared 2-core machine, cold
    assert len(rows) == len(WORLDS) + sum(s < w for w in WORLDS for s in (8, 64, 512))
    assert [r.shard_group for r in rows[:2]] == [8, 16] and rows[-1].world_size == 65536


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        predict_step("llama3-8b", 12, 8)
    with pytest.raises(ValueError, match="unknown model"):
        predict_step("gpt5", 8)
    with pytest.raises(ValueError, match="divides none"):
        sweep("llama3-8b", [8, 16], [3])
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0, 1e-6)
    with pytest.raises(ValueError, match="latency"):
        Link(1e9, -1.0)


def test_fit_link_recovers_alpha_and_beta_exactly() -> None:
    alpha, beta = 23e-6, 1.7e9
    samples = [(m, x, (m - 1) * (alpha + x / beta)) for m in (2, 4) for x in (1e3, 6.4e4, 1e6, 4e6)]
    link = fit_link(samples)
    assert link.latency == pytest.approx(alpha, rel=1e-9) and link.bandwidth == pytest.approx(beta, rel=1e-9)
    with pytest.raises(ValueError, match="different chunk sizes"):
        fit_link([(2, 1e3, 1e-3), (4, 1e3, 3e-3)])
    with pytest.raises(ValueError, match="alpha-beta form"):
        fit_link([(2, 1e3, 1e-3), (2, 1e6, 1e-4)])  # bigger messages faster: negative 1/beta


def test_cli_simulate_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sim.json"
    argv = ["simulate", "--model", "llama3-8b", "--world-size", "8,1024,65536", "--hsdp-shard", "8,64",
            "--compute-ms", "500", "--json", str(path)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["model", "world", "shard", "repl"] and "exposed" in lines[0]
    assert len(lines) == 1 + 7
    records = json.loads(path.read_text())
    assert [(r["world_size"], r["shard_group"]) for r in records] == [
        (8, 8), (1024, 1024), (1024, 8), (1024, 64), (65536, 65536), (65536, 8), (65536, 64)]
    assert records[5]["seconds"] == pytest.approx(predict_step("llama3-8b", 65536, 8).seconds)
    for argv in (["simulate", "--model", "llama3-8b", "--world-size", "12", "--hsdp-shard", "8"],
                 ["simulate", "--model", "llama3-8b", "--world-size", "8", "--inter-gbps", "0"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


BLOCKS = python_blocks("simulator.md")


def test_docs_page_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_docs_example_runs(index: int) -> None:
    exec_source(BLOCKS[index], f"simulator.md[{index}]")
