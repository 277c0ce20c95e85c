"""One CuTe decode at `bench_cute_decode.py`'s shape under Nsight Compute: what limits its bandwidth.

    python3 benchmarks/gpu/profile_cute_decode.py [--page-size 64] [--kernels cute,triton] [--out DIR]
    python3 benchmarks/gpu/profile_cute_decode.py --dry-run      # on CPU: commands built, workload tiny

Needs the CuTe DSL kit for the CuTe kernel (`. /tmp/kit/env.sh`, or a call after kit-b). Per kernel
family in `--kernels` (cute: `PagedDecodeSm90`; triton: its `_attention_kernel`, the contrast):

1. kernel times without ncu attached: the decode run `TIMED_CALLS` times under torch.profiler,
   µs per kernel (decode, split merge), and the decode kernel's GB/s and fraction of the copy
   bandwidth measured in the same process, printed at once as a `ROW {json}` line (a verdict in
   benchmarks/gpu/session.py);
2. `ncu` on a fresh process that makes `WARMUP_CALLS` calls (the first compiles) and one more,
   profiling only that last decode kernel (`--launch-skip`, `--launch-count 1`) with `SECTIONS`
   and the warp stall reasons, clocks left to the GPU (`--clock-control none`).

Writes `profile_cute_decode.txt` (the kernel times, each ncu command and its full details page) to
`--out` (default `$BENCH_RESULTS_DIR`, else `$OUT`, else benchmarks/results) and prints a summary
table last. Exits 1 when a profile could not be taken (no ncu, no counter permission): the last
line says why. Compiled CuTe kernels are shared between the processes through
`TORCH_PAGED_KV_CUTE_CACHE_DIR` (default /tmp/cute_cache). About 30 s per kernel family on an H100.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
REPORT = "profile_cute_decode.txt"
WARMUP_CALLS = 2
TIMED_CALLS = 20
COPY = "copy GB/s"  # the device-to-device copy bandwidth (read + write) the timed workload measures too
KERNELS = {"cute": "PagedDecodeSm90", "triton": "_attention_kernel"}
"""Each family's decode kernel: the `ncu --kernel-name regex:` that picks it."""
SHORT_NAMES = {"PagedDecodeSm90": "cute decode", "SplitCombine": "cute merge", "_attention_kernel": "triton decode"}
SHORT_NAMES["_merge_kernel"] = "triton merge"
SECTIONS = (
    "SpeedOfLight",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
    "LaunchStats",
    "Occupancy",
    "SchedulerStats",
    "WarpStateStats",
    "InstructionStats",
)
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
SUMMARY = (
    "Duration",
    "DRAM Throughput",
    "Memory Throughput",
    "Compute (SM) Throughput",
    "SM Frequency",
    "Grid Size",
    "Registers Per Thread",
    "Dynamic Shared Memory Per Block",
    "Block Limit Registers",
    "Block Limit Shared Mem",
    "Theoretical Occupancy",
    "Achieved Occupancy",
    "Waves Per SM",
    "Executed Instructions",
    "Issued Warp Per Scheduler",
    "No Eligible",
    "Warp Cycles Per Issued Instruction",
)
"""Metrics of the details page put in the summary table (ncu's names), then the top stall reasons."""
TOP_STALLS = 5


def find_ncu() -> str | None:
    """`ncu` from PATH, else the newest CUDA toolkit's or Nsight Compute install's."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = glob.glob("/usr/local/cuda*/bin/ncu") + glob.glob("/opt/nvidia/nsight-compute/*/ncu")
    return sorted(candidates)[-1] if candidates else None


def workload_command(kernel: str, page_size: int, dry_run: bool) -> list[str]:
    """The process ncu profiles: `WARMUP_CALLS + 1` decode calls of `kernel`'s family."""
    command = [sys.executable, str(Path(__file__).resolve()), "--workload", kernel, "--page-size", str(page_size)]
    return command + (["--dry-run"] if dry_run else [])


def ncu_command(ncu: str, kernel: str, report: Path, workload: list[str], stalls: bool = True) -> list[str]:
    """Profile the last of the workload's decode kernels with `SECTIONS` (and the stall reasons) into `report`."""
    command = [ncu, "--target-processes", "all", "--kernel-name", f"regex:{KERNELS[kernel]}"]
    command += ["--launch-skip", str(WARMUP_CALLS), "--launch-count", "1", "--clock-control", "none"]
    for section in SECTIONS:
        command += ["--section", section]
    if stalls:
        command += ["--metrics", STALLS]
    return [*command, "--force-overwrite", "--export", str(report), *workload]


def details_commands(ncu: str, report: Path) -> tuple[list[str], list[str]]:
    """(text, CSV) of the report's details page."""
    base = [ncu, "--import", str(report), "--page", "details"]
    return base, [*base, "--csv"]


def summarize(details_csv: str) -> dict[str, str]:
    """`SUMMARY` metrics ("value unit") and the `TOP_STALLS` largest stall reasons from ncu's details CSV."""
    lines = details_csv.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)  # after any ==PROF== lines
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[header:])))) if header is not None else []
    if not rows or "Metric Name" not in rows[0]:
        return {}
    found = {row["Metric Name"]: f"{row['Metric Value']} {row.get('Metric Unit') or ''}".strip() for row in rows}
    summary = {name: found[name] for name in SUMMARY if name in found}
    stalls = []
    for name, value in found.items():
        if name.startswith("smsp__average_warps_issue_stalled_"):
            reason = name.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio")
            stalls.append((_number(value), reason))
    for number, reason in sorted(stalls, reverse=True)[:TOP_STALLS]:
        summary[f"stall: {reason}"] = f"{number:.2f} cycles/issue"
    return summary


def _number(text: str) -> float:
    try:
        return float(text.split()[0].replace(",", ""))
    except (ValueError, IndexError):
        return 0.0


# -- the workload (in its own process) ---------------------------------------------------------------


def workload(kernel: str, page_size: int, dry_run: bool, timed: int) -> dict[str, float]:
    """Decode calls of `kernel`'s family at the benchmark's shape: `WARMUP_CALLS` and one more, or with
    `timed`, also that many under torch.profiler; returns µs per kernel (short names) per call."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    sys.path.insert(0, str(BENCHMARKS))
    import torch
    from bench_cute_decode import DRY_SHAPE, DTYPE, SHAPE
    from harness import paged_decode_inputs

    device = torch.device("cpu" if dry_run else "cuda")
    x = paged_decode_inputs(**(DRY_SHAPE if dry_run else SHAPE), page_size=page_size, dtype=DTYPE, device=device)
    backend = "reference" if dry_run and kernel == "cute" else kernel  # CuTe needs CUDA: its stand-in on CPU
    run = x.paged_attention(backend)
    for _ in range(WARMUP_CALLS + 1):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if not timed:
        return {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(timed):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        name = next((short for key, short in SHORT_NAMES.items() if key in event.key), None)
        device_us = getattr(event, "self_device_time_total", 0.0)
        if name is not None and device_us > 0:
            times[name] = times.get(name, 0.0) + device_us / timed
    if device.type == "cuda":
        from harness import copy_bandwidth_gbps

        times[COPY] = copy_bandwidth_gbps(device)
    return times


def kernel_times(kernel: str, page_size: int, dry_run: bool, log: list[str]) -> tuple[dict[str, float], str]:
    """`workload` with `TIMED_CALLS` in a fresh process (no profiler attached to the process ncu
    uses): µs per kernel, and why it failed ('' when it ran)."""
    timed = 2 if dry_run else TIMED_CALLS
    command = [*workload_command(kernel, page_size, dry_run), "--timed", str(timed)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    log += [f"$ {' '.join(command)}", done.stdout, done.stderr[-3000:]]
    times = {}
    for line in done.stdout.splitlines():
        if line.startswith("KERNEL "):
            name, us = line.removeprefix("KERNEL ").rsplit(" ", 1)
            times[name] = float(us)
    last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "")
    return times, f"workload exit {done.returncode}: {last[:160]}" if done.returncode else ""


def decode_row(kernel: str, page_size: int, us: float | None, copy_gbps: float | None, why_not: str) -> dict:
    """The decode kernel's time as a benchmark row (`harness.DecodeBench.row`'s keys): µs, GB/s of
    `harness.decode_bytes` at the benchmark's shape and its fraction of `copy_gbps`; without a time,
    `us` says why (`unavailable: ...`)."""
    row = {"kernel": f"{kernel} decode kernel", "page_size": page_size, "us": f"unavailable: {why_not}"}
    row |= {"GB/s": None, "of_copy": None}
    if us and copy_gbps:
        sys.path.insert(0, str(BENCHMARKS))
        from bench_cute_decode import DTYPE, SHAPE
        from harness import decode_bytes

        gbps = decode_bytes(**SHAPE, dtype=DTYPE) / us / 1e3
        row |= {"us": us, "GB/s": gbps, "of_copy": gbps / copy_gbps}
    return row


# -- the driver ----------------------------------------------------------------------------------------


def profile(kernel: str, ncu: str | None, page_size: int, dry_run: bool, log: list[str]) -> tuple[dict[str, str], str]:
    """ncu's summary of `kernel`'s decode and, when it could not be taken, why ('' when it was)."""
    report = Path(os.environ.get("TMPDIR", "/tmp")) / f"profile_{kernel}_decode.ncu-rep"
    command = ncu_command(ncu or "ncu", kernel, report, workload_command(kernel, page_size, dry_run))
    log.append(f"$ {' '.join(command)}")
    if dry_run:
        return {}, ""
    if ncu is None:
        return {}, "ncu not found (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"
    report.unlink(missing_ok=True)  # a report left by an earlier run must not pass for this one's
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    if done.returncode != 0 or not report.is_file():  # e.g. a stall metric this ncu does not know: once more without
        log += [done.stdout[-4000:], done.stderr[-4000:], "(again without the stall metrics)"]
        command = ncu_command(ncu, kernel, report, workload_command(kernel, page_size, dry_run), stalls=False)
        log.append(f"$ {' '.join(command)}")
        done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    log += [done.stdout[-4000:], done.stderr[-4000:]]
    if done.returncode != 0 or not report.is_file():
        error = next((line for line in (done.stdout + done.stderr).splitlines() if "ERR" in line), "")
        return {}, f"ncu exit {done.returncode}: {error[:160] or 'no report written'}"
    text, as_csv = details_commands(ncu, report)
    log.append(subprocess.run(text, capture_output=True, text=True, timeout=120).stdout)
    return summarize(subprocess.run(as_csv, capture_output=True, text=True, timeout=120).stdout), ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kernels", default="cute,triton", help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--out", default=None, help="folder of the report (default: $BENCH_RESULTS_DIR or $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="on CPU: tiny workload, ncu commands only printed")
    parser.add_argument("--workload", choices=KERNELS, help=argparse.SUPPRESS)  # the profiled process
    parser.add_argument("--timed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload:
        for name, us in workload(args.workload, args.page_size, args.dry_run, args.timed).items():
            print(f"KERNEL {name} {us:.1f}", flush=True)
        return 0

    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels: unknown {unknown}, expected some of {list(KERNELS)}")
    out = Path(args.out or os.environ.get("BENCH_RESULTS_DIR") or os.environ.get("OUT") or BENCHMARKS / "results")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_PAGED_KV_CUTE_CACHE_DIR", "/tmp/cute_cache")  # compile once for all processes
    ncu = find_ncu()
    log = [f"ncu: {ncu or 'not found'}; page size {args.page_size}; dry run: {args.dry_run}"]
    columns: dict[str, dict[str, str]] = {}
    failures = []
    for kernel in kernels:
        start = time.monotonic()
        times, failure = kernel_times(kernel, args.page_size, args.dry_run, log)
        copy_gbps = times.pop(COPY, None)
        column = {f"{name} us": f"{us:.1f}" for name, us in sorted(times.items())}
        why_not = failure or ("dry run (CPU)" if args.dry_run else "no decode kernel in the torch.profiler trace")
        row = decode_row(kernel, args.page_size, times.get(f"{kernel} decode"), copy_gbps, why_not)
        print("ROW", json.dumps(row), flush=True)  # benchmarks/gpu/session.py makes it a verdict at once
        if row["GB/s"] is not None:
            column["decode kernel GB/s"] = f"{row['GB/s']:.0f} ({row['of_copy']:.2f} of copy)"
        summary, profile_failure = profile(kernel, ncu, args.page_size, args.dry_run, log)
        column.update(summary)
        column["seconds"] = f"{time.monotonic() - start:.0f}"
        columns[kernel] = column
        print(f"{kernel}: {column}", flush=True)
        failures += [f"{kernel}: {why}" for why in (failure, profile_failure) if why]
    (out / REPORT).write_text("\n".join(log) + "\n")

    names = list(dict.fromkeys(name for column in columns.values() for name in column))
    print(f"\n| metric | {' | '.join(kernels)} |\n|---|{'---|' * len(kernels)}")
    for name in names:
        print(f"| {name} | {' | '.join(columns[k].get(name, '-') for k in kernels)} |")
    print(f"\nreport: {out / REPORT}" + (" (dry run: the ncu commands were not run)" if args.dry_run else ""))
    if failures:
        print("no profile: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
