"""``layout-planner``: padding reports over the model catalog.

    layout-planner report --model llama3-70b --world-size 256 --unit rows:128
    layout-planner report --model all --world-size 8,64,256,1024 --unit rows:1,rows:16
    layout-planner simulate --model llama3-70b --world-size 8,1024,65536 --hsdp-shard 8,64
    layout-planner models
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from layout_planner.catalog import catalog, get_model
from layout_planner.comm_model import Cluster, Link
from layout_planner.report import format_table, report_model
from layout_planner.simulate import format_predictions, sweep
from layout_planner.units import parse_unit


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _world_sizes(text: str) -> list[int]:
    sizes = []
    for item in _list(text):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"world sizes must be positive integers, got {item!r}")
        sizes.append(int(item))
    return sizes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layout-planner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="padding per group: plan, buckets, FSDP2, naive LCM and the bound")
    report.add_argument("--model", default="all", help="catalog name(s), comma-separated, or 'all' (default)")
    report.add_argument("--world-size", type=_world_sizes, required=True, help="rank count(s), comma-separated")
    report.add_argument(
        "--unit", default="rows:1", help="elements:N, rows:N or matrix; comma-separated (default rows:1)"
    )
    report.add_argument("--align", type=int, default=4, help="alignment in elements (default 4: 16 bytes of fp32)")
    report.add_argument("--max-buckets", type=int, default=4, help="bucket limit for plan_buckets (default 4)")
    report.add_argument("--json", action="store_true", help="print JSON records instead of the table")
    _add_simulate(sub)
    sub.add_parser("models", help="list the catalog")
    return parser


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="predicted per-step communication: FSDP and HSDP over world sizes")
    sim.add_argument("--model", required=True, help="catalog name")
    sim.add_argument("--world-size", type=_world_sizes, required=True, help="rank count(s), comma-separated")
    sim.add_argument("--hsdp-shard", type=_world_sizes, default=[], help="HSDP shard-group size(s), comma-separated")
    sim.add_argument("--unit", default="rows:1", help="elements:N, rows:N or matrix (default rows:1)")
    sim.add_argument("--align", type=int, default=4, help="alignment in elements (default 4)")
    sim.add_argument("--max-buckets", type=int, default=1, help="buffers per group, one collective each (default 1)")
    sim.add_argument("--param-bytes", type=int, default=2, help="bytes per all-gathered element (default 2: bf16)")
    sim.add_argument("--reduce-bytes", type=int, default=4, help="bytes per reduced element (default 4: fp32)")
    sim.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    sim.add_argument("--intra-gbps", type=float, default=450.0, help="intra-node GB/s per GPU each way (default 450)")
    sim.add_argument("--inter-gbps", type=float, default=50.0, help="inter-node GB/s per GPU each way (default 50)")
    sim.add_argument("--intra-latency-us", type=float, default=3.4, help="intra-node us per ring step (default 3.4)")
    sim.add_argument("--inter-latency-us", type=float, default=9.6, help="inter-node us per ring step (default 9.6)")
    sim.add_argument("--compute-ms", type=float, default=None, help="step compute time, for the exposed column")
    sim.add_argument("--json", metavar="PATH", default=None, help="also write the predictions as JSON to PATH")


def _simulate(args: argparse.Namespace) -> str:
    cluster = Cluster(
        args.gpus_per_node,
        Link(args.intra_gbps * 1e9, args.intra_latency_us * 1e-6),
        Link(args.inter_gbps * 1e9, args.inter_latency_us * 1e-6),
    )
    rows = sweep(args.model, args.world_size, args.hsdp_shard, rule=parse_unit(args.unit), cluster=cluster,
                 param_bytes=args.param_bytes, reduce_bytes=args.reduce_bytes, align=args.align,
                 max_buckets=args.max_buckets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    compute = None if args.compute_ms is None else args.compute_ms * 1e-3
    return format_predictions(rows, compute)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status (0 on success, 2 on a usage error).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "models":
        for model in catalog().values():
            print(f"{model.name:15} {model.numel / 1e9:7.2f}B  {model.description}")
        return 0
    if args.command == "simulate":
        try:
            print(_simulate(args))
        except ValueError as exc:
            parser.error(str(exc))
        return 0
    try:
        names = list(catalog()) if args.model == "all" else _list(args.model)
        models = [get_model(name) for name in names]
        rules = [parse_unit(u) for u in _list(args.unit)]
        rows = [
            row
            for model in models
            for size in args.world_size
            for rule in rules
            for row in report_model(model, size, rule, align=args.align, max_buckets=args.max_buckets)
        ]
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1))
    else:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
