"""Run PyTorch's own FSDP2 tests against fsdp: the conformance suite of the drop-in claim.

PyTorch's tests stay outside this repository. Extract them from a pytorch clone at the
commit of the installed torch (``python -c 'import torch; print(torch.version.git_version)'``)::

    git -C pytorch archive <commit> test/distributed/_composable/fsdp | tar -x -C /tmp/fsdp2_tests

then run, from the repository root, the baseline on torch's own FSDP2 and fsdp against it::

    T=/tmp/fsdp2_tests/test/distributed/_composable/fsdp
    hatch run python tools/fsdp2_conformance.py $T --impl torch --ungate
    hatch run python tools/fsdp2_conformance.py $T --ungate \
        --baseline benchmarks/results/fsdp2_conformance_baseline.json

Each test file runs under pytest in a subprocess with ``tools/fsdp2_shim`` first on
``PYTHONPATH``: its ``sitecustomize`` rebinds ``torch.distributed.fsdp.fully_shard``,
``FSDPModule``, ``UnshardHandle`` and ``register_fsdp_forward_method`` to fsdp's in the
pytest process and in every rank it spawns (``--impl torch`` leaves torch's in place).
``--ungate`` lifts ``skip_if_lt_x_gpu`` for the in-process (``FSDPTestMultiThread``) tests,
and ``--baseline`` counts only the tests that pass on torch's own FSDP2 in this
environment: those are the CPU-capable ones, the conformance suite. Per test it prints
pass / fail / skip; failures listed in ``EXCLUSIONS`` (tests of FSDP2's own placement,
padding or private classes, and features fsdp rejects by design) print as ``excluded``
with the reason, anything else as ``fail``. Results go to
``benchmarks/results/fsdp2_conformance.json`` (``..._baseline.json`` for ``--impl torch``).

torch's test utilities import ``expecttest``; where the environment lacks it, install it
outside the project (``pip install --target /tmp/fsdp2_deps expecttest``) and pass
``--deps /tmp/fsdp2_deps``.
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
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM_DIR = Path(__file__).resolve().parent / "fsdp2_shim"
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_JSON = {"fsdp": RESULTS / "fsdp2_conformance.json",
                "torch": RESULTS / "fsdp2_conformance_baseline.json"}


@dataclass(frozen=True)
class Exclusion:
    """Why a PyTorch test is expected to fail on fsdp.

    ``kind`` is ``"placement"`` (asserts FSDP2's ``Shard(0)`` layout or padded shapes),
    ``"private"`` (reaches into FSDP2's private classes or state), ``"by-design"`` (a
    feature fsdp rejects with a clear error on every rank) or ``"extends"`` (fsdp accepts
    what FSDP2 rejects, with correct results). Differences that are bugs are not listed:
    they stay ``FAIL`` until fixed.
    """

    kind: str
    reason: str


_INIT = "test_fully_shard_init.py::"
_TRAINING = "test_fully_shard_training.py::"
_NO_SHARD_DIM = Exclusion("by-design", "shard_placement_fn returning Shard(d > 0) raises ValueError: "
                          "RaggedShard keeps whole units of the flattened tensor (use unit_policy)")
_PRIVATE_STATE = Exclusion("private", "reads FSDP2's private state (fully_shard.state(m)._is_root, "
                           "._state_ctx, ._fsdp_param_group, ._lazy_init())")
_PRIVATE_MANAGED = Exclusion("private", "calls torch's private _get_managed_modules/_get_managed_states, "
                             "which only recognise torch's own fully_shard state on submodules")
_INT_RESHARD = Exclusion("by-design", "loops over reshard_after_forward=2: an int raises "
                         "NotImplementedError (no resharding to a smaller world after forward)")
_NO_HOOK = Exclusion("by-design", "set_all_reduce_hook raises NotImplementedError: the HSDP "
                     "all-reduce is part of DBuffer's reduction")

EXCLUSIONS: dict[str, Exclusion] = {
    _INIT + "TestFullyShardShardedParameterTensor.test_shard_tensor_parameters": Exclusion(
        "placement", "asserts placements == (Shard(0),) and local == torch.chunk(param)[rank]"),
    _INIT + "TestFullyShardHSDPBroadcast.test_hsdp_broadcast_across_replicas": Exclusion(
        "placement", "assumes every rank holds part of every parameter; RaggedShard gives a rank "
        "zero elements of a parameter whose units all fall on other ranks (empty == empty)"),
    _INIT + "TestFullyShardManagedModulesAndStates.test_managed_modules_nested": _PRIVATE_MANAGED,
    _INIT + "TestFullyShardManagedModulesAndStates.test_managed_modules_nested_fully_shard_and_replicate":
        _PRIVATE_MANAGED,
    _INIT + "TestFullyShardManagedModulesAndStates.test_managed_states_nested_fully_shard":
        _PRIVATE_MANAGED,
    _INIT + "TestFullyShardLazyInit.test_fully_shard_is_root": _PRIVATE_STATE,
    _INIT + "TestFullyShardLazyInit.test_fully_shard_module_and_param_fqns": _PRIVATE_STATE,
    _INIT + "TestFullyShardLazyInit.test_fully_shard_double_lazy_init": _PRIVATE_STATE,
    _INIT + "TestFullyShardLazyInit.test_fully_shard_multi_module_root": _PRIVATE_STATE,
    _INIT + "TestFullyShardShardPlacementFn.test_init_1d_transformer_shard_largest_dim": _NO_SHARD_DIM,
    _INIT + "TestFullyShardShardPlacementFn.test_init_1d_transformer_shard_dim_neg1": _NO_SHARD_DIM,
    _INIT + "TestFullyShardShardPlacementFn.test_init_2d_transformer_shard_diff_dim": _NO_SHARD_DIM,
    _INIT + "TestFullyShardShardPlacementFn.test_init_1d_uneven_shard_largest_dim": _NO_SHARD_DIM,
    _INIT + "TestFullyShardShardPlacementFn.test_invalid_shard_dim": _NO_SHARD_DIM,
    _TRAINING + "TestFullyShardShardPlacementFnMultiThread.test_shard_placement_fn_contiguous_params_grads":
        _NO_SHARD_DIM,
    _INIT + "TestHSDPWithCustomHook.test_custom_hook_custom_stream": _NO_HOOK,
    _INIT + "TestHSDPWithCustomHook.test_custom_hsdp_all_reduce_hook": _NO_HOOK,
    _INIT + "TestFullyShardShardedParameterDTensor.test_shard_dtensor_parameters": Exclusion(
        "by-design", "tensor-parallel DTensor parameters raise NotImplementedError naming the "
        "parameter (fsdp does not compose with TP); the test also asserts FSDP2's placements"),
    _INIT + "TestFullyShardShardedParameterTensor.test_raise_noncontiguous_parameter": Exclusion(
        "extends", "expects NotImplementedError for a channels_last parameter; fsdp shards it and "
        "matches the unsharded module's output and weights exactly"),
    _TRAINING + "TestFullyShardRegisteredParams.test_param_registration_after_forward": _INT_RESHARD,
    _TRAINING + "TestFullyShardRegisteredParams.test_param_registration_after_backward": _INT_RESHARD,
    _TRAINING + "TestFullyShardRegisteredParams.test_modules_to_run_forward_empty_for_single_module":
        Exclusion("private", "reads FSDPState._modules_to_run_forward"),
}


@dataclass(frozen=True)
class TestResult:
    """One test's outcome: ``pass``, ``fail``, ``excluded``, ``skip`` or ``error``;
    ``baseline`` is the same test's outcome on torch's own FSDP2 (when given)."""

    file: str
    test: str
    status: str
    detail: str
    baseline: str = ""


def run_file(path: Path, impl: str, deps: list[str], timeout: float,
             ungate: bool) -> tuple[list[TestResult], str]:
    """Run one test file under pytest; returns its results and a file-level note."""
    env = dict(os.environ)
    env["FSDP2_CONFORMANCE_UNGATE"] = "1" if ungate else "0"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM_DIR), str(path.parent), *deps, env.get("PYTHONPATH", "")]
    )
    env["FSDP2_CONFORMANCE_IMPL"] = impl
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "fsdp2_compat",
               "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(path.parent),
               "-o", "junit_logging=all", f"--junitxml={report}"]
        # A session of its own, so a timeout also ends the rank processes pytest spawned.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [], f"not run: timed out after {timeout:.0f} s"
        if not report.exists():
            return [], f"pytest exited {proc.returncode} without a report: {_first_line(stderr)}"
        return _parse_report(report, path.name, impl), f"pytest exit {proc.returncode}"


def _parse_report(report: Path, file: str, impl: str) -> list[TestResult]:
    results = []
    for case in ET.parse(report).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        status, detail = "pass", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "fail", "error": "error", "skipped": "skip"}[tag]
                logs = "\n".join((n.text or "") for n in (node, case.find("system-out"),
                                                             case.find("system-err")) if n is not None)
                detail = _exception_line(logs) or _first_line(node.get("message") or "")
                break
        exclusion = EXCLUSIONS.get(f"{file}::{test}")
        if impl == "fsdp" and status in ("fail", "error") and exclusion is not None:
            status, detail = "excluded", f"[{exclusion.kind}] {exclusion.reason}"
        results.append(TestResult(file, test, status, detail))
    return results


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*")
_LOG_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+\] ")


def _exception_line(traceback: str) -> str:
    """The last ``SomeError: message`` line: for a rank thread's failure, the rank's own."""
    lines = (_LOG_PREFIX.sub("", line).strip() for line in traceback.splitlines())
    found = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return found[-1][:300] if found else ""


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def main(argv: list[str] | None = None) -> int:
    """Command line: run the files, print per-test outcomes and counts, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_dir", type=Path,
                        help="the extracted test/distributed/_composable/fsdp directory")
    parser.add_argument("--impl", choices=("fsdp", "torch"), default="fsdp")
    parser.add_argument("--files", nargs="*", help="test file names (default: every test_*.py)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per file")
    parser.add_argument("--deps", action="append", default=[],
                        help="extra PYTHONPATH entry (e.g. where expecttest is installed)")
    parser.add_argument("--ungate", action="store_true",
                        help="run accelerator-gated in-process tests on CPU as well")
    parser.add_argument("--baseline", type=Path,
                        help="JSON of a --impl torch run: conformance counts only tests that "
                             "pass there (the CPU-capable ones)")
    parser.add_argument("--update", action="store_true",
                        help="keep the other files' results already in the JSON (rerun a file)")
    parser.add_argument("--json", type=Path, help="where to write the results (default: "
                        "benchmarks/results/fsdp2_conformance[_baseline].json)")
    args = parser.parse_args(argv)
    baseline = ({f"{t['file']}::{t['test']}": t["status"]
                 for t in json.loads(args.baseline.read_text())["tests"]}
                if args.baseline else {})

    files = ([args.test_dir / name for name in args.files] if args.files
             else sorted(args.test_dir.glob("test_*.py")))
    results: list[TestResult] = []
    notes: dict[str, str] = {}
    for path in files:
        start = time.perf_counter()
        file_results, note = run_file(path, args.impl, args.deps, args.timeout, args.ungate)
        file_results = [replace(r, baseline=baseline.get(f"{r.file}::{r.test}", ""))
                        for r in file_results]
        notes[path.name] = f"{note} ({time.perf_counter() - start:.0f} s)"
        print(f"== {path.name}: {notes[path.name]}", flush=True)
        for r in file_results:
            base = f" (torch: {r.baseline})" if r.baseline else ""
            print(f"  {r.status:8s} {r.test}{base}" + (f"  -- {r.detail}" if r.detail else ""),
                  flush=True)
        results.extend(file_results)

    out = args.json or DEFAULT_JSON[args.impl]
    if args.update and out.exists():
        previous = json.loads(out.read_text())
        notes = {**{f: n for f, n in previous["files"].items() if f not in notes}, **notes}
        kept = [TestResult(**t) for t in previous["tests"] if t["file"] not in
                {path.name for path in files}]
        if baseline:
            kept = [replace(r, baseline=baseline.get(f"{r.file}::{r.test}", "")) for r in kept]
        results = sorted(kept + results, key=lambda r: r.file)

    counted = [r for r in results if not baseline or r.baseline == "pass"]
    counts = {s: sum(r.status == s for r in counted)
              for s in ("pass", "fail", "error", "excluded", "skip")}
    if baseline:
        counts["not_cpu_capable"] = len(results) - len(counted)
    print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "impl": args.impl,
        "torch": torch.__version__,
        "torch_git_version": torch.version.git_version,
        "ungate": args.ungate,
        "baseline": str(args.baseline) if args.baseline else None,
        "files": notes,
        "counts": counts,
        "tests": [asdict(r) for r in results],
    }, indent=1) + "\n")
    return 1 if counts["fail"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
