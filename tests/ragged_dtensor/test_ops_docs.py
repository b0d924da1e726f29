"""The ```python blocks of docs/ragged-dtensor-ops.md run, in order, as one script on 4 gloo ranks."""

from __future__ import annotations

from pathlib import Path

from tests.ragged_dtensor.test_core_docs import python_blocks

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ragged-dtensor-ops.md"


def run_page(source: str) -> bool:
    namespace: dict = {"__name__": "ragged_dtensor_ops_docs"}
    exec(compile(source, str(PAGE), "exec"), namespace)
    return True


def test_ops_docs_examples_run_on_four_ranks(ranks) -> None:
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 9
    assert ranks.run(4, run_page, "\n".join(blocks)) == [True] * 4
