"""The ```python blocks of docs/ragged-dtensor.md run, in order, as one script on 4 gloo ranks."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ragged-dtensor.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def run_page(source: str) -> bool:
    namespace: dict = {"__name__": "ragged_dtensor_docs"}
    exec(compile(source, str(PAGE), "exec"), namespace)
    return True


def test_docs_examples_run_on_four_ranks(ranks) -> None:
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 8
    assert ranks.run(4, run_page, "\n".join(blocks)) == [True] * 4
