"""``layout-planner``: padding reports over the model catalog.

    layout-planner report --model llama3-70b --world-size 256 --unit rows:128
    layout-planner report --model all --world-size 8,64,256,1024 --unit rows:1,rows:16
    layout-planner models
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from layout_planner.catalog import catalog, get_model
from layout_planner.report import format_table, report_model
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
    sub.add_parser("models", help="list the catalog")
    return parser


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
