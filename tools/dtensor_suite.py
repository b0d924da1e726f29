"""Run PyTorch's own DTensor tests with and without this project imported, and compare.

Importing ``fsdp`` must leave torch's DTensor, DCP and exception handling as torch has them,
and installing ragged_dtensor's patches (the first RaggedShard does) must leave them as torch
has them for every placement but RaggedShard. This script runs PyTorch's own tests of
``test/distributed/tensor/`` and ``test/distributed/checkpoint/test_state_dict.py`` on CPU/gloo
once per mode and compares per-test outcomes:

* ``plain``: torch alone (the baseline);
* ``fsdp``: ``import fsdp`` at interpreter start in every process (``tools/dtensor_shim``'s
  ``sitecustomize``, first on ``PYTHONPATH``, so the pytest process and every rank it spawns);
* ``installed``: as ``fsdp``, then ``ragged_dtensor.install()``: every patch in place.

PyTorch's tests stay outside this repository. Take them from the pytorch repository at (or
nearest to) the installed torch's commit
(``python -c 'import torch; print(torch.version.git_version)'``) into a folder that mirrors the
repository, e.g. ``/tmp/dtensor_tests/test/distributed/tensor/test_dtensor.py``, and run::

    python tools/dtensor_suite.py /tmp/dtensor_tests --deps /tmp/fsdp2_deps --ungate
    python tools/dtensor_suite.py /tmp/dtensor_tests --modes plain installed --files test_dtensor.py

Each file is copied into a temporary folder with hard-coded ``cuda`` devices (and
``torch.cuda.device_count()``, ``nccl``) switched to CPU ones and runs under pytest in a
subprocess per mode. ``--ungate`` also runs the accelerator-gated tests on CPU (as
``tools/fsdp2_conformance.py --ungate`` does), in every mode alike. Per file it prints the counts passed
in each mode and every test that passes ``plain`` but not in another mode (a regression: the
run exits 1). torch's test utilities import ``expecttest``: install it outside the project
(``pip install --target /tmp/fsdp2_deps expecttest``) and pass ``--deps /tmp/fsdp2_deps``.
Results go to ``benchmarks/results/dtensor_suite.json`` (``--json`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from fsdp2_conformance import (TestResult, _exception_line, _first_line, _parse_log,
                               _parse_report)

ROOT = Path(__file__).resolve().parents[1]
SHIM_DIR = Path(__file__).resolve().parent / "dtensor_shim"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "dtensor_suite.json"
MODES = ("plain", "fsdp", "installed")

#: the files, most important first (paths inside the pytorch repository)
FILES = tuple(f"test/distributed/tensor/{name}" for name in (
    "test_dtensor.py", "test_redistribute.py")) + (
    "test/distributed/checkpoint/test_state_dict.py",) + tuple(
    f"test/distributed/tensor/{name}" for name in (
        "test_pointwise_ops.py", "test_math_ops.py", "test_view_ops.py", "test_tensor_ops.py",
        "test_matrix_ops.py", "test_embedding_ops.py", "test_init.py", "test_random_ops.py",
        "test_optimizers.py"))

#: hard-coded accelerator devices -> cpu (the suites run on CPU/gloo)
_CPU_REWRITES = ((re.compile(r"torch\.cuda\.device_count\(\)"),
                  'torch.get_device_module("cpu").device_count()'),
                 (re.compile(r"""(["'])cuda(:\d+)?\1"""), r"\1cpu\1"),
                 (re.compile(r"\.cuda\(\)"), ".cpu()"),
                 (re.compile(r"""(["'])nccl\1"""), r"\1gloo\1"))


def cpu_copy(source: Path, folder: Path) -> tuple[Path, int]:
    """Copy ``source`` into ``folder`` with hard-coded cuda/nccl switched to cpu/gloo; returns
    the copy and the number of rewrites."""
    text, count = source.read_text(), 0
    for pattern, replacement in _CPU_REWRITES:
        text, n = pattern.subn(replacement, text)
        count += n
    target = folder / source.name
    target.write_text(text)
    return target, count


def run_file(path: Path, mode: str, deps: list[str], timeout: float,
             ungate: bool) -> tuple[list[TestResult], str]:
    """Run one (prepared) test file under pytest in ``mode``; returns its results and a note."""
    env = dict(os.environ)
    env["DTENSOR_SUITE_MODE"] = mode
    env["DTENSOR_SUITE_UNGATE"] = "1" if ungate else "0"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM_DIR), str(path.parent), *deps, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        report, log = Path(tmp) / "report.xml", Path(tmp) / "log.txt"
        # -v: a file over ``timeout`` keeps the tests it finished (read from these lines)
        cmd = [sys.executable, "-m", "pytest", str(path), "-v", "-p", "no:cacheprovider",
               "-c", os.devnull, "--rootdir", str(path.parent), "-o", "junit_logging=all",
               f"--junitxml={report}"]
        with log.open("w") as out:
            # a session of its own, so a timeout also ends the rank processes pytest spawned
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return (_parse_log(log.read_text(errors="replace"), path, "torch", deps),
                        f"timed out after {timeout:.0f} s (killed; finished tests kept)")
        output = log.read_text(errors="replace")
        if "Error in sitecustomize" in output:
            # Python goes on without the shim, so the mode would silently be ``plain``
            return [], f"not run: the shim failed: {_exception_line(output)}"
        if not report.exists():
            return [], f"pytest exited {proc.returncode} without a report: {_first_line(output)}"
        return _parse_report(report, path.name, "torch"), f"pytest exit {proc.returncode}"


def compare(results: dict[str, list[TestResult]]) -> tuple[dict[str, int], list[dict[str, str]]]:
    """Per mode the number of passes, and every test that passes ``plain`` but not another mode."""
    counts = {mode: sum(r.status == "pass" for r in rs) for mode, rs in results.items()}
    plain = {r.test: r for r in results.get("plain", [])}
    regressions = []
    for mode, rs in results.items():
        if mode == "plain":
            continue
        got = {r.test: r for r in rs}
        for test, base in plain.items():
            if base.status == "pass" and (test not in got or got[test].status != "pass"):
                now = got.get(test)
                regressions.append({"file": base.file, "test": test, "mode": mode,
                                    "status": now.status if now else "missing",
                                    "detail": now.detail if now else ""})
    return counts, regressions


def main(argv: list[str] | None = None) -> int:
    """Command line: run the files in each mode, print counts and regressions, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_root", type=Path,
                        help="folder mirroring the pytorch repository (holds test/distributed/...)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["plain", "fsdp"])
    parser.add_argument("--files", nargs="*", help="file names to run (default: all, most "
                        "important first)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per file and mode")
    parser.add_argument("--deps", action="append", default=[],
                        help="extra PYTHONPATH entry (e.g. where expecttest is installed)")
    parser.add_argument("--ungate", action="store_true",
                        help="run accelerator-gated tests on CPU, the CPU device module "
                             "reporting --cpu-devices devices (every mode alike)")
    parser.add_argument("--cpu-devices", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=1,
                        help="(file, mode) runs at a time (each is its own pytest process)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    os.environ["DTENSOR_SUITE_CPU_DEVICES"] = str(args.cpu_devices)
    if "plain" not in args.modes:
        args.modes.insert(0, "plain")

    chosen = [f for f in FILES if not args.files or Path(f).name in args.files]
    summary: dict[str, dict[str, object]] = {}
    all_regressions: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = {}
        for relative in chosen:
            source = args.test_root / relative
            if not source.exists():
                print(f"== {source.name}: not found under {args.test_root}", flush=True)
                continue
            prepared[source.name] = cpu_copy(source, Path(tmp))

        def run(job: tuple[str, str]) -> tuple[list[TestResult], str]:
            name, mode = job
            start = time.perf_counter()
            results, note = run_file(prepared[name][0], mode, args.deps, args.timeout,
                                     args.ungate)
            return results, f"{note} ({time.perf_counter() - start:.0f} s)"

        # (file, mode) runs are independent processes: --jobs of them at a time, the most
        # important files first
        jobs = [(name, mode) for name in prepared for mode in args.modes]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            done = dict(zip(jobs, pool.map(run, jobs)))
        for name, (_, rewrites) in prepared.items():
            results = {mode: done[(name, mode)][0] for mode in args.modes}
            notes = {mode: done[(name, mode)][1] for mode in args.modes}
            counts, regressions = compare(results)
            all_regressions += regressions
            summary[name] = {"rewrites": rewrites, "notes": notes, "passed": counts,
                             "tests": len(results["plain"]),
                             "regressions": regressions,
                             "results": {m: [asdict(r) for r in rs] for m, rs in results.items()}}
            passed = ", ".join(f"{m} {n}" for m, n in counts.items())
            print(f"== {name}: {len(results['plain'])} tests; passed: {passed}; "
                  f"{len(regressions)} pass plain and fail with the import "
                  f"({'; '.join(f'{m}: {n}' for m, n in notes.items())})", flush=True)
            for r in regressions:
                print(f"  REGRESSION [{r['mode']}] {r['test']}: {r['status']} {r['detail']}",
                      flush=True)
    import torch

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "torch": torch.__version__, "torch_git_version": torch.version.git_version,
        "modes": args.modes, "files": summary}, indent=1) + "\n")
    print(f"regressions: {len(all_regressions)}")
    return 1 if all_regressions else 0


if __name__ == "__main__":
    sys.exit(main())
