"""`pip install packages/layout-planner` into a bare venv pulls nothing else, and the CLI works."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

import layout_planner

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bare_venv_install(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}

    def run(*args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    site = next(env_dir.glob("lib*/python*/site-packages"), None) or env_dir / "Lib" / "site-packages"
    before = {p.name for p in site.iterdir()}
    # hatchling comes from the index into pip's isolated build environment, not into the venv.
    package = str(ROOT / "packages" / "layout-planner")
    run(str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", package)
    added = {p.name for p in site.iterdir()} - before
    assert added == {"layout_planner", f"layout_planner-{layout_planner.__version__}.dist-info"}, added
    cli = str(bindir / "layout-planner")
    out = run(cli, "report", "--model", "llama3-8b", "--world-size", "1024", "--unit", "rows:1")
    assert "llama3-8b" in out and "7.69%" in out
