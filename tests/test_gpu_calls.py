"""The preset GPU calls (benchmarks/gpu/) without a GPU: every dry run passes end to end, a typo in a
test id fails the dry run, verdicts read pytest's and the benchmarks' output right, and a hung test
ends at its deadline with its name in the log."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"
_spec = importlib.util.spec_from_file_location("gpu_session", GPU / "session.py")
session = sys.modules["gpu_session"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(session)


def test_every_dry_run_passes_end_to_end(tmp_path):
    """What the lead types, in dry-run mode: every step runs or is collected, every verdict passes,
    the summary table comes last, and at most 6 files come back from `$OUT`."""
    runs = {}
    for call in session.CALLS:  # all at once: each mostly waits on imports
        out = tmp_path / call
        env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
        env.pop("TRITON_INTERPRET", None)  # the driver sets what its steps need
        command = ["bash", str(GPU / f"{call}.sh"), "--dry-run"]
        runs[call] = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for call, proc in runs.items():
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-4000:]
        verdicts = [line.split() for line in output.splitlines() if line.startswith("VERDICT ")]
        names = {v[1] for v in verdicts}
        assert {step.name for step in session.CALLS[call].steps} <= names, output[-3000:]
        assert all(v[2] == "PASS" for v in verdicts), [v for v in verdicts if v[2] != "PASS"]
        lines = output.rstrip().splitlines()
        table = lines[lines.index(next(line for line in lines if line.startswith("== summary"))) + 1 :]
        assert table[0] == "| step | verdict | s | figure |" and len(table) == len(verdicts) + 2
        files = [p for p in (tmp_path / call).rglob("*") if p.is_file()]
        assert len(files) <= 6 and (tmp_path / call / f"{call}.log").is_file(), files


def test_a_test_id_that_does_not_exist_fails_the_dry_run(tmp_path):
    s = session.Session("call1", True, tmp_path)
    s.collected = ["tests/gpu/a.py::test_x[1]", "tests/gpu/a.py::test_x[2]", "tests/gpu/b.py::test_y"]
    step = session.Step("s", "pytest", ("tests/gpu/a.py::test_x",), cap_s=1)
    assert s._dry_pytest(step).figure == "dry run: 2 tests collected"
    typo = session.Step("s", "pytest", ("tests/gpu/a.py::test_z",), cap_s=1)
    assert s._dry_pytest(typo).verdict == "FAIL"
    everything = session.Step("s", "pytest", ("tests/gpu/b.py", "--deselect", "tests/gpu/b.py::test_y"), cap_s=1)
    assert s._dry_pytest(everything).verdict == "FAIL"


def test_pytest_verdicts():
    ok = ["tests/gpu/a.py::test_x PASSED", "===== 3 passed, 1 skipped in 2.0s ====="]
    assert session.pytest_verdict("a", 0, ok, 60, 30).figure == "3 passed, 1 skipped"
    bad = ["tests/gpu/a.py::test_x FAILED", "FAILED tests/gpu/a.py::test_x - assert 1 == 2", "== 1 failed in 1s =="]
    verdict = session.pytest_verdict("a", 1, bad, 60, 30)
    assert verdict.verdict == "FAIL" and "tests/gpu/a.py::test_x - assert 1 == 2" in verdict.figure
    skipped = ["SKIPPED [2] tests/gpu/a.py:3: no kit", "== 2 skipped in 1s =="]
    assert session.pytest_verdict("a", 0, skipped, 60, 30).verdict == "FAIL"
    hung = ["tests/gpu/a.py::test_x PASSED", "tests/gpu/a.py::test_y Timeout (0:00:30)!", "Thread 0x1"]
    verdict = session.pytest_verdict("a", 1, hung, 60, 30)
    assert verdict.verdict == "TIMEOUT" and verdict.figure.startswith("tests/gpu/a.py::test_y ran past")
    assert session.pytest_verdict("a", None, hung[:2], 60, 30).verdict == "TIMEOUT"


def test_benchmark_rows_become_verdicts():
    timed = dict(kernel="triton paged", page_size=16, us=100.0, **{"GB/s": 2000.0}, of_copy=0.66)
    timed |= dict(target=">= 0.7 of copy", meets=False)
    verdict = session.row_verdict("bench", timed, dry_run=False)
    assert verdict.name == "bench:triton-paged@p16" and verdict.verdict == "PASS"
    assert verdict.figure == "100.0 us, 2000 GB/s, 0.66 of copy (target >= 0.7 of copy: MISSED)"
    for us in ("WRONG: triton: mismatch", "unavailable: ImportError: x"):
        assert session.row_verdict("bench", dict(kernel="k", us=us), dry_run=False).verdict == "FAIL"
    assert session.row_verdict("bench", dict(kernel="k", us="unavailable: x"), dry_run=True).verdict == "PASS"


HUNG = """
import time

def test_quick():
    pass

def test_hangs():
    time.sleep(60)
"""


def test_a_hung_test_ends_at_its_deadline_with_its_name_in_the_log(tmp_path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    env = {**os.environ, "PYTHONPATH": str(GPU)}
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-v", "-p", "deadline_plugin", "--deadline", "2", "test_hung.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert time.monotonic() - start < 50 and done.returncode != 0
    lines = done.stdout.splitlines()
    verdict = session.pytest_verdict("hung", done.returncode, lines, 60, 2)
    assert verdict.verdict == "TIMEOUT" and verdict.figure.startswith("test_hung.py::test_hangs ran past"), lines


@pytest.mark.parametrize("call", sorted(session.CALLS))
def test_each_call_fits_the_timeout_the_docs_give_it(call):
    """docs/benchmarks.md's table gives each call's command, carry and timeout_s: the budget leaves a
    minute of that timeout for the last step's kill and the kit's copy; the command is a script."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith(f"| {call[-1]} | `bash benchmarks/gpu/{call}.sh`"))
    carry, timeout = row.split(" | ")[2:4]
    assert carry == {"call1": '`[".kit/a"]`', "call2": '`[".kit/b"]`'}.get(call, "`[]`")
    assert session.CALLS[call].budget_s + 60 <= int(timeout) <= 600


def test_a_shorter_budget_ends_the_call_sooner_and_never_extends_it(tmp_path):
    """`--budget`: for a call issued with less device time left; it never raises the call's own."""
    assert session.Session("call3", True, tmp_path, budget_s=120).spec.budget_s == 120
    assert session.Session("call3", True, tmp_path, budget_s=9999).spec.budget_s == session.CALLS["call3"].budget_s
    spent = session.Session("call3", False, tmp_path, budget_s=5)  # under 10 s left: no step starts
    assert spent.blocked(spent.spec.steps[0]).verdict == "TIMEOUT"
