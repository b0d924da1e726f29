"""Run PyTorch's own FSDP2 tests against fsdp: the conformance suite of the drop-in claim.

PyTorch's tests stay outside this repository. Extract ``test/distributed/_composable/fsdp``
from a pytorch checkout at the installed torch's commit
(``python -c 'import torch; print(torch.version.git_version)'``) into
``/tmp/fsdp2_tests/test/distributed/_composable/fsdp``. Where no checkout can be had, use
the newest stored version of each file that runs on torch 2.13 and put a first-lines comment
``# Transcribed from pytorch/pytorch@<commit>`` in it: the JSON records that commit per file.
The run of 2026-11-26 used (torch 2.13.0 is ``cf30153c``, not stored by the code index):
training ``001df7b5``, frozen ``04fb872f``, autograd ``23477856``, state_dict ``01c2204b``,
clip_grad_norm_ ``0f31e612``, ignore_params ``05a963fb``, mixed_precision ``003a6c0a``,
init ``009e587c``, state ``2c50e08a``, with ``FSDP2_CONFORMANCE_CPU_DEVICES=4``.
torch's test utilities import ``expecttest``: ``pip install --target /tmp/fsdp2_deps
expecttest`` and pass ``--deps /tmp/fsdp2_deps``. Then, from the repository root, the
baseline on torch's own FSDP2 and fsdp against it::

    T=/tmp/fsdp2_tests/test/distributed/_composable/fsdp
    python tools/fsdp2_conformance.py $T --impl torch --ungate --cpu-rewrite --deps /tmp/fsdp2_deps
    python tools/fsdp2_conformance.py $T --ungate --cpu-rewrite --deps /tmp/fsdp2_deps \
        --baseline benchmarks/results/fsdp2_conformance_baseline.json

Each file runs under pytest in a subprocess of its own session, from a staging copy (with
``--cpu-rewrite``, ``CPU_REWRITES`` applied: tests written for CUDA that only name the
device, and one private module path torch 2.13 dropped), with ``tools/fsdp2_shim`` first on
``PYTHONPATH``. Its ``sitecustomize`` runs in the pytest process and in every rank process
the multi-process ``FSDPTest`` classes spawn: with ``--impl fsdp`` it rebinds
``torch.distributed.fsdp.fully_shard``, ``FSDPModule``, ``UnshardHandle``,
``register_fsdp_forward_method`` and ``share_comm_ctx`` (and the legacy
``torch.distributed._composable.fsdp`` names) to fsdp's; with ``--ungate`` it makes
``skip_if_lt_x_gpu`` allow CPU and, without an accelerator, reports 8 devices, so
``FSDPTest`` runs its ranks on CPU/gloo instead of skipping. No run can hang: a file over
``--timeout`` is killed with its whole process group (the tests it finished are kept), and
each multi-process test is failed by torch's harness after ``--test-timeout`` seconds.

``--baseline`` counts only the tests that pass on torch's own FSDP2 in this environment
(the CPU-capable ones, the conformance suite). Per test it prints pass / fail / skip;
failures listed in ``EXCLUSIONS`` (tests that assert FSDP2's own layout) print as
``excluded`` with the assertion, anything else as ``fail``. Results go to
``benchmarks/results/fsdp2_conformance.json`` (``..._baseline.json`` for ``--impl torch``),
rewritten after every file.
"""

from __future__ import annotations

import argparse
import contextlib
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
    """A PyTorch test that asserts FSDP2's own layout, so it cannot pass on fsdp.

    Only layout assertions qualify (issue 19): ``Shard(0)`` / ``torch.chunk`` shard shapes,
    padded storage, ``_StridedShard``, exact collective counts, a rank's local shard being
    non-empty. ``assertion`` names the assertion that depends on the layout. Anything else
    that fails on fsdp stays ``fail``, with its cause in ``CAUSES``.
    """

    assertion: str


_INIT = "test_fully_shard_init.py::"
_TRAINING = "test_fully_shard_training.py::"
_STATE_DICT = "test_fully_shard_state_dict.py::"
_CLIP = "test_fully_shard_clip_grad_norm_.py::"

EXCLUSIONS: dict[str, Exclusion] = {
    _INIT + "TestFullyShardShardedParameterTensor.test_shard_tensor_parameters": Exclusion(
        "placements == (Shard(0),) and to_local() == torch.chunk(param)[rank]"),
    # Uneven TP composes since ragged-dtensor 0.4; what is left is FSDP2's placement by name.
    _INIT + "TestFullyShardShardedParameterDTensor.test_shard_dtensor_parameters": Exclusion(
        "_spec.placements == (_StridedShard(0, split_factor=tp), Shard(0)) for in_proj and "
        "(Shard(0), ...) for the rest, where fsdp's are (RaggedShard, Shard(0)) and "
        "(RaggedShard, ...)"),
    _INIT + "TestFullyShardHSDPBroadcast.test_hsdp_broadcast_across_replicas": Exclusion(
        "every rank's local shard of every parameter is non-empty"),
    # The rest of the test holds on fsdp (checked on 2026-11-28, 2 ranks, norms 2 and inf):
    # full gradients equal the replicated model's, the total norm is the same, one all-reduce
    # per mesh dim, and every non-empty local gradient is clipped.
    _CLIP + "TestClipGradNormWorldSize2.test_clip_grad_norm_1d": Exclusion(
        "vector_norm(p.grad.to_local()) > max_norm for every parameter on every rank: a rank "
        "holding no units of a parameter has an empty local gradient (norm 0)"),
    _INIT + "TestHSDPWithCustomHook.test_custom_hsdp_all_reduce_hook": Exclusion(
        "out_proj.weight.grad.to_local() == torch.full((5, 40), ...): the Shard(0) chunk of a "
        "(10, 40) weight on every rank"),
    # With that one assertion removed (an empty local shard is allowed only on ranks > 0),
    # both tests pass on fsdp (checked on 2026-11-26, 4 ranks).
    _STATE_DICT + "TestFullyShardStateDictMultiProcess.test_dp_tp_state_dict_save_load":
        Exclusion("assertGreater(self.rank, 0) where to_local() is empty: rank 0 holds part of "
                  "every parameter"),
    _STATE_DICT + "TestFullyShardStateDictMultiProcess.test_hsdp_tp_state_dict_save_load":
        Exclusion("assertGreater(self.rank, 0) where to_local() is empty: rank 0 holds part of "
                  "every parameter"),
    # shard_placement_fn: Shard(d > 0) is FSDP2's cut since fsdp 0.6 (fsdp.dim_shard). With
    # the assertion named removed, each of these passes on fsdp (checked on 2026-11-27, 4
    # and 8 ranks); test_dp_state_dict_save_load's Shard(largest dim) subtests included.
    _INIT + "TestFullyShardShardPlacementFn.test_init_1d_transformer_shard_largest_dim":
        Exclusion("assertIsInstance(param.placements[0], Shard) for every parameter: those "
                  "sharded along dim 0 are RaggedShard"),
    _INIT + "TestFullyShardShardPlacementFn.test_init_2d_transformer_shard_diff_dim":
        Exclusion("isinstance(placement, Shard) for every placement of every parameter: the "
                  "dp placement of those sharded along dim 0 is RaggedShard"),
    _STATE_DICT + "TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load":
        Exclusion("assertGreater(self.rank, 0) where to_local() is empty: rank 0 holds part of "
                  "every parameter"),
    _TRAINING + "TestFullyShardShardPlacementFnMultiThread."
                "test_shard_placement_fn_contiguous_params_grads":
        Exclusion("param.is_contiguous() and to_local().is_contiguous() for Shard(1) "
                  "parameters and gradients: fsdp's are dim-permuted views of its buffers "
                  "(no copy), FSDP2's are copies out of the all-gather output"),
    # The grouped model (fully_shard([norm, head])) and the ungrouped one plan different
    # buffers, so a rank's run of a parameter differs between them; FSDP2's Shard(0) shard
    # does not depend on the grouping.
    _TRAINING + "TestFullyShard1DTrainingCompose.test_partial_group_forward_grad_accum_chunked":
        Exclusion("grouped_p.grad.to_local() == ungrouped_p.grad.to_local() (shard shapes "
                  "independent of the grouping)"),
    _TRAINING + "TestFullyShard1DTrainingCompose.test_partial_group_forward_then_standalone":
        Exclusion("ug_p.grad.to_local() == fsdp_p.grad.to_local() across groupings (shard "
                  "shapes independent of the grouping)"),
}


# Root causes of the failures seen on fsdp (not exclusions: each is a difference to close or
# a documented design choice). The id is printed with the failure and stored in the JSON.
CAUSE_TEXT: dict[str, str] = {
    "fsdp2-private": "reads FSDP2's private state that fsdp has no counterpart of, or calls "
                     "torch's private FSDP2 helpers on fsdp's modules (_comm_ctx, "
                     "_get_managed_modules, RegisterPostBackwardFunction)",
}

_FROZEN = "test_fully_shard_frozen.py::TestFullyShardFrozen."
_MANAGED = _INIT + "TestFullyShardManagedModulesAndStates."
_LAZY = _INIT + "TestFullyShardLazyInit."

# Which cause each observed failure has (read from its traceback and the test's source).
CAUSES: dict[str, str] = {
    _FROZEN + "test_train_mixed_requires_grad_per_group": "fsdp2-private",
    _FROZEN + "test_train_mixed_requires_grad_across_groups": "fsdp2-private",
    _MANAGED + "test_managed_modules_nested": "fsdp2-private",
    _MANAGED + "test_managed_modules_nested_fully_shard_and_replicate": "fsdp2-private",
    _MANAGED + "test_managed_states_nested_fully_shard": "fsdp2-private",
    _TRAINING + "TestFullyShardShareCommContext.test_share_comm_context": "fsdp2-private",
}


@dataclass(frozen=True)
class Rewrite:
    """A mechanical rewrite of PyTorch's test source: tests written for CUDA that only name
    the device, or an import of a module path torch 2.13 dropped. Applied to a copy of the
    file (``--cpu-rewrite``), for both implementations alike; the JSON lists which ones hit
    each file."""

    name: str
    pattern: str
    replacement: str


CPU_REWRITES = (
    Rewrite("cuda-tensor", r"\.cuda\(\)", '.to("cpu")'),
    Rewrite("cuda-device-arg", r"""device=(["'])cuda\1""", 'device="cpu"'),
    Rewrite("cuda-mesh", r"""init_device_mesh\(\s*(["'])cuda\1""", 'init_device_mesh("cpu"'),
    Rewrite("cuda-device-count", r"torch\.cuda\.device_count\(\)", "torch.cpu.device_count()"),
    Rewrite("ddp-device-ids", r"device_ids=\[self\.rank\]", "device_ids=None"),
    Rewrite("current-accelerator", r"torch\.accelerator\.current_accelerator\(\)\.type",
            '"cpu"'),
    Rewrite("cuda-only-skip", r"""@unittest\.skipIf\(not TEST_CUDA, "no cuda"\)\n\s*""", ""),
    Rewrite("instantiate-for-cpu", r"""except_for=\[(["'])cpu\1\],\s*""", ""),
    # Not a device name: torch 2.13 no longer has the private alias the stored
    # clip_grad_norm_ file imports CommDebugMode from (the public module is the same class).
    Rewrite("dtensor-debug-module", r"torch\.distributed\._tensor\.debug",
            "torch.distributed.tensor.debug"),
)


def rewrite_for_cpu(source: str) -> tuple[str, list[str]]:
    """``source`` with every ``CPU_REWRITES`` entry applied; and the names that matched."""
    hits = []
    for rewrite in CPU_REWRITES:
        source, count = re.subn(rewrite.pattern, rewrite.replacement, source)
        if count:
            hits.append(f"{rewrite.name} x{count}")
    return source, hits


_SOURCE_LINE = re.compile(r"^# Transcribed from (pytorch/pytorch@[0-9a-f]{40})", re.M)


def source_commit(path: Path) -> str:
    """The ``pytorch/pytorch@<commit>`` a test file came from, from its header line."""
    match = _SOURCE_LINE.search(path.read_text())
    return match[1] if match else "unknown"


@dataclass(frozen=True)
class TestResult:
    """One test's outcome: ``pass``, ``fail``, ``excluded``, ``skip`` or ``error``;
    ``baseline`` is the same test's outcome on torch's own FSDP2 (when given)."""

    file: str
    test: str
    status: str
    detail: str
    baseline: str = ""
    cause: str = ""


def run_file(path: Path, impl: str, deps: list[str], timeout: float, ungate: bool,
             test_timeout: int) -> tuple[list[TestResult], str]:
    """Run one test file under pytest; returns its results and a file-level note.

    pytest runs in a session of its own, so a file over ``timeout`` is ended with every rank
    process it spawned (``killpg``); the tests it finished are still read from its verbose
    log, the one in progress is reported as ``error`` (timed out), the rest as ``not run``.
    ``test_timeout`` bounds each multi-process test (torch's harness reads it from
    ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` and fails the test when a rank exceeds it).
    """
    env = dict(os.environ)
    env["FSDP2_CONFORMANCE_UNGATE"] = "1" if ungate else "0"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM_DIR), str(path.parent), *deps, env.get("PYTHONPATH", "")]
    )
    env["FSDP2_CONFORMANCE_IMPL"] = impl
    env["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(test_timeout)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        report, log = Path(tmp) / "report.xml", Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", "pytest", str(path), "-v", "-p", "no:cacheprovider",
               "-c", os.devnull, "--rootdir", str(path.parent),
               "-o", "junit_logging=all", f"--junitxml={report}"]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True, cwd=path.parent)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return (_parse_log(log.read_text(errors="replace"), path, impl, deps),
                        f"timed out after {timeout:.0f} s (killed)")
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # no rank outlives its file
        if not report.exists():
            return [], (f"pytest exited {proc.returncode} without a report: "
                        f"{_first_line(log.read_text(errors='replace'))}")
        results = _parse_report(report, path.name, impl)
        # pytest reports a file it cannot import as one classless case: the file ran no
        # test, so it is a note on the file rather than a test counted as ``error``
        uncollected = [r for r in results if r.test.startswith(".")]
        if uncollected:
            return ([r for r in results if r not in uncollected],
                    f"not collected (pytest exit {proc.returncode}): {uncollected[0].detail}")
        return results, f"pytest exit {proc.returncode}"


_VERBOSE_LINE = re.compile(r"^\S+::(\w+)::(\w+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_VERBOSE_START = re.compile(r"^\S+::(\w+)::(\w+) ")


def _parse_log(log: str, path: Path, impl: str, deps: list[str]) -> list[TestResult]:
    """Outcomes of a file that timed out, from pytest's ``-v`` lines; the tests it did not
    reach (collected again, with ``deps`` on the path as in the run) are ``not-run``."""
    statuses = {"PASSED": "pass", "FAILED": "fail", "ERROR": "error", "SKIPPED": "skip",
                "XFAIL": "skip", "XPASS": "pass"}
    results, started = [], None
    for line in log.splitlines():
        if match := _VERBOSE_LINE.match(line):
            results.append(_classify(path.name, f"{match[1]}.{match[2]}",
                                     statuses[match[3]], "", impl))
            started = None
        elif match := _VERBOSE_START.match(line):
            started = f"{match[1]}.{match[2]}"
    if started is not None:
        results.append(_classify(path.name, started, "error", "timed out (file killed)", impl))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", str(path), "--collect-only", "-q", "-p",
         "no:cacheprovider", "-c", os.devnull, "--rootdir", str(path.parent)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(SHIM_DIR), str(path.parent), *deps, os.environ.get("PYTHONPATH", "")])},
        capture_output=True, text=True, timeout=300, cwd=path.parent).stdout
    done = {r.test for r in results}
    for line in collected.splitlines():
        parts = line.strip().split("::")
        if len(parts) == 3 and f"{parts[1]}.{parts[2]}" not in done:
            results.append(TestResult(path.name, f"{parts[1]}.{parts[2]}", "not-run",
                                      "file timed out before this test"))
    return results


def _classify(file: str, test: str, status: str, detail: str, impl: str) -> TestResult:
    exclusion = EXCLUSIONS.get(f"{file}::{test}")
    if impl == "fsdp" and status in ("fail", "error") and exclusion is not None:
        status, detail = "excluded", f"[layout] {exclusion.assertion}"
    cause = CAUSES.get(f"{file}::{test}", "") if status in ("fail", "error") else ""
    return TestResult(file, test, status, detail, cause=cause)


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
        results.append(_classify(file, test, status, detail, impl))
    return results


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*")
_LOG_PREFIX = re.compile(r"^(\[rank\d+\]:)?[EWI]\d{4} [\d:.]+ \d+ \S+\] ")
_HARNESS_LINE = re.compile(r"^RuntimeError: Process \d+ (exited|terminated)|^AssertionError: \d+ unit test")


def _exception_line(traceback: str) -> str:
    """The last ``SomeError: message`` line: for a rank thread's failure, the rank's own."""
    lines = (_LOG_PREFIX.sub("", line).strip() for line in traceback.splitlines())
    found = [line for line in lines if _EXCEPTION_LINE.match(line)]
    # A rank's own exception, rather than the harness line reporting that a rank exited.
    own = [line for line in found if not _HARNESS_LINE.match(line)]
    return (own or found)[-1][:300] if found else ""


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def write_results(args: argparse.Namespace, baseline: dict[str, str], notes: dict[str, dict],
                  results: list[TestResult], final: bool = False) -> dict[str, int]:
    """Write the JSON (after every file, so a run cut short keeps what it finished);
    returns the counts."""
    out = args.json or DEFAULT_JSON[args.impl]
    if args.update and out.exists():
        previous = json.loads(out.read_text())
        ran = set(notes)
        notes = {**{f: n for f, n in previous["files"].items() if f not in ran}, **notes}
        kept = [TestResult(**t) for t in previous["tests"] if t["file"] not in ran]
        if baseline:
            kept = [replace(r, baseline=baseline.get(f"{r.file}::{r.test}", "")) for r in kept]
        results = sorted(kept + results, key=lambda r: r.file)

    counted = [r for r in results if not baseline or r.baseline == "pass"]
    counts = {s: sum(r.status == s for r in counted)
              for s in ("pass", "fail", "error", "excluded", "skip", "not-run")}
    if baseline:
        counts["not_cpu_capable"] = len(results) - len(counted)
    if final:
        print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "impl": args.impl,
        "torch": torch.__version__,
        "torch_git_version": torch.version.git_version,
        "ungate": args.ungate,
        "cpu_rewrite": args.cpu_rewrite,
        "baseline": str(args.baseline) if args.baseline else None,
        "files": notes,
        "counts": counts,
        "tests": [asdict(r) for r in results],
    }, indent=1) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    """Command line: run the files, print per-test outcomes and counts, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_dir", type=Path,
                        help="the extracted test/distributed/_composable/fsdp directory")
    parser.add_argument("--impl", choices=("fsdp", "torch"), default="fsdp")
    parser.add_argument("--files", nargs="*", help="test file names (default: every test_*.py)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per file")
    parser.add_argument("--test-timeout", type=int, default=300,
                        help="seconds per multi-process test (torch's harness fails it after)")
    parser.add_argument("--deps", action="append", default=[],
                        help="extra PYTHONPATH entry (e.g. where expecttest is installed)")
    parser.add_argument("--ungate", action="store_true",
                        help="run accelerator-gated in-process tests on CPU as well")
    parser.add_argument("--cpu-rewrite", action="store_true",
                        help="apply CPU_REWRITES to a copy of each file (CUDA-only device "
                             "names, a moved module path)")
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
    notes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fsdp2_conformance_") as staging:
        # The files run from a copy (with the CPU rewrites if asked), next to copies of
        # their sibling modules, so the extracted tree stays as PyTorch has it.
        hits = {}
        for source in args.test_dir.glob("*.py"):
            text = source.read_text()
            if args.cpu_rewrite:
                text, hits[source.name] = rewrite_for_cpu(text)
            (Path(staging) / source.name).write_text(text)
        for path in files:
            start = time.perf_counter()
            file_results, note = run_file(Path(staging) / path.name, args.impl, args.deps,
                                          args.timeout, args.ungate, args.test_timeout)
            file_results = [replace(r, baseline=baseline.get(f"{r.file}::{r.test}", ""))
                            for r in file_results]
            seconds = round(time.perf_counter() - start)
            notes[path.name] = {"note": note, "seconds": seconds,
                                "source": source_commit(path),
                                "cpu_rewrites": hits.get(path.name, [])}
            print(f"== {path.name}: {note} ({seconds} s)", flush=True)
            for r in file_results:
                base = f" (torch: {r.baseline})" if r.baseline else ""
                print(f"  {r.status:8s} {r.test}{base}" + (f"  -- {r.detail}" if r.detail else ""),
                      flush=True)
            results.extend(file_results)
            write_results(args, baseline, notes, results)

    counts = write_results(args, baseline, notes, results, final=True)
    return 1 if counts["fail"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
