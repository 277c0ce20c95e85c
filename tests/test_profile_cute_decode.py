"""benchmarks/gpu/profile_cute_decode.py without a GPU: the dry run runs the workload on CPU and writes
the ncu commands it would run; a broken workload fails it; the summary reads ncu's details CSV."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "profile_cute_decode.py"
_spec = importlib.util.spec_from_file_location("profile_cute_decode", SCRIPT)
profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile)


def dry_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--kernels", "cute", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_dry_run_writes_the_ncu_command_and_a_table_last(tmp_path):
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == [profile.REPORT]  # one file comes back
    report = (tmp_path / profile.REPORT).read_text()
    (ncu,) = [line for line in report.splitlines() if line.startswith("$ ") and "--kernel-name" in line]
    assert "--kernel-name regex:PagedDecodeSm90 --launch-skip 2 --launch-count 1" in ncu
    assert all(f"--section {section}" in ncu for section in profile.SECTIONS)
    assert ncu.endswith("--workload cute --page-size 64 --dry-run")  # the process it profiles
    lines = done.stdout.rstrip().splitlines()
    (row,) = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
    assert row["kernel"] == "cute decode kernel" and row["us"] == "unavailable: dry run (CPU)"
    table = lines.index("| metric | cute |")
    assert lines[table + 1] == "|---|---|" and lines[-1].startswith("report: ")


def test_a_workload_that_fails_fails_the_dry_run(tmp_path):
    done = dry_run(tmp_path, "--page-size", "0")
    assert done.returncode == 1
    assert done.stdout.rstrip().splitlines()[-1].startswith("no profile: cute: workload exit 1")


HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def details(metrics: list[tuple[str, str, str]]) -> str:
    launch = '"0","1","python3","h","kernel","1","7","(160,1,1)","(64,8,1)","0","9.0","S"'
    rows = [f'{launch},"{name}","{unit}","{value}"' for name, unit, value in metrics]
    return "\n".join(["==PROF== Connected to process 1", HEADER, *rows]) + "\n"


def test_summary_reads_the_details_csv_and_ranks_the_stalls():
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    stalls = {"short_scoreboard": "10.50", "wait": "3.20", "long_scoreboard": "2.10", "barrier": "0.10"}
    stalls |= {"mio_throttle": "7.00", "math_pipe_throttle": "0.50", "selected": "1,001.00"}
    summary = profile.summarize(
        details(
            [("Duration", "ms", "1.60"), ("Block Limit Shared Mem", "block", "2"), ("Elapsed Cycles", "cycle", "9")]
            + [(stall.format(name), "", value) for name, value in stalls.items()]
        )
    )
    assert summary["Duration"] == "1.60 ms" and summary["Block Limit Shared Mem"] == "2 block"
    assert "Elapsed Cycles" not in summary  # only `SUMMARY` metrics
    ranked = [name for name in summary if name.startswith("stall: ")]
    top = ["selected", "short_scoreboard", "mio_throttle", "wait", "long_scoreboard"]
    assert ranked == [f"stall: {name}" for name in top]
    assert summary["stall: selected"] == "1001.00 cycles/issue"


def test_summary_of_no_csv_is_empty():
    assert profile.summarize("") == {}
    assert profile.summarize("==ERROR== ERR_NVGPUCTRPERM - no permission\n") == {}


def fake_ncu(folder: Path, details_csv: str, *, refuse_metrics: bool = False, profile_nothing: bool = False) -> str:
    """An `ncu` that writes a report for `--export` (unless `profile_nothing`: no kernel matched), fails
    when asked for `--metrics` with `refuse_metrics`, and prints `details_csv` for `--import --csv`."""
    script = folder / "ncu"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "args = sys.argv[1:]\n"
        "if '--import' in args:\n"
        f"    print({details_csv!r} if '--csv' in args else 'details page')\n"
        "    sys.exit(0)\n"
        f"if {refuse_metrics!r} and '--metrics' in args:\n"
        "    print('==ERROR== Failed to find metric'); sys.exit(1)\n"
        f"if not {profile_nothing!r}:\n"
        "    open(args[args.index('--export') + 1], 'w').write('report')\n"
        "print('==WARNING== No kernels were profiled.' if " + repr(profile_nothing) + " else '')\n"
    )
    script.chmod(0o755)
    return str(script)


def test_profile_runs_ncu_then_reads_the_details_page(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    (tmp_path / "profile_cute_decode.ncu-rep").write_text("an earlier run's")
    csv_text = details([("Duration", "us", "712.00")])
    log: list[str] = []
    summary, failure = profile.profile("cute", fake_ncu(tmp_path, csv_text), 64, False, log)
    assert (summary, failure) == ({"Duration": "712.00 us"}, "")
    assert "details page\n" in log  # the text page goes to the report


def test_profile_retries_without_the_stall_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    log: list[str] = []
    ncu = fake_ncu(tmp_path, details([("Duration", "us", "1.0")]), refuse_metrics=True)
    summary, failure = profile.profile("cute", ncu, 64, False, log)
    runs = [line for line in log if line.startswith("$ ") and "--kernel-name" in line]
    assert failure == "" and summary == {"Duration": "1.0 us"}
    assert len(runs) == 2 and "--metrics" in runs[0] and "--metrics" not in runs[1]


def test_profile_of_no_matched_kernel_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    (tmp_path / "profile_cute_decode.ncu-rep").write_text("an earlier run's")  # must not pass for this one
    ncu = fake_ncu(tmp_path, details([("Duration", "us", "1.0")]), profile_nothing=True)
    summary, failure = profile.profile("cute", ncu, 64, False, [])
    assert summary == {} and failure == "ncu exit 0: no report written"


def test_decode_row_counts_the_benchmark_bytes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cute_decode import DTYPE, SHAPE
    from harness import decode_bytes

    row = profile.decode_row("cute", 64, 1000.0, 3000.0, "")
    assert row["us"] == 1000.0 and row["GB/s"] == decode_bytes(**SHAPE, dtype=DTYPE) / 1e6
    assert row["of_copy"] == row["GB/s"] / 3000.0
    assert profile.decode_row("cute", 64, None, 3000.0, "workload exit 1")["us"] == "unavailable: workload exit 1"
