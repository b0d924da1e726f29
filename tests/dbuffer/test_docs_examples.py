"""The ```python blocks of docs/dbuffer.md run, in order, on two gloo ranks."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "dbuffer.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def _run_page(blocks: list[str]) -> int:
    namespace: dict[str, object] = {"__name__": "dbuffer_docs"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs
    return len(blocks)


def test_docs_examples_run_on_two_ranks(ranks) -> None:
    blocks = _blocks()
    assert len(blocks) >= 6
    assert ranks.run(2, _run_page, blocks) == [len(blocks)] * 2
