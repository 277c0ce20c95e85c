"""The preset calls of a GPU visit: steps run in turn, each in its own process under a time cap,
each ending in `VERDICT <name> PASS|FAIL|TIMEOUT <figure>` lines; a summary table prints last.

    bash benchmarks/gpu/call1.sh [--dry-run]   # carry .kit/a: env, probes, decode GB/s, FP8, generation, Triton tests
    bash benchmarks/gpu/call2.sh [--dry-run]   # carry .kit/b: CuTe kit, CuTe tests, GB/s and profile
    bash benchmarks/gpu/call3.sh [--dry-run]   # MLA, variant, CUDA-path tests; MLA tiles, compiled generate, window

A call stops starting steps when its budget (`CALLS[...].budget_s`) is spent, so it returns well
inside the device tool's timeout. Kernel-family probes run one test each with
`CUDA_LAUNCH_BLOCKING=1` (a faulting launch is named, and cannot poison the next probe's context).
pytest runs verbose, with a per-test deadline (`deadline_plugin.py`), so a hang or a kill leaves the
test's name in the log. Benchmarks print each row as it is measured (`ROW {json}`), and each row
becomes a verdict at once. Everything goes to stdout and `$OUT/<call>.log`, the summary to
`$OUT/<call>.md`, a benchmark's table and JSON beside them (`BENCH_RESULTS_DIR`): at most 6 files a call.

`--dry-run` runs the same call on a machine without a GPU: the pytest steps are collected (one
collection per call; every named test must exist), the benchmarks run at tiny sizes on CPU tensors
(Triton in its interpreter), the kit steps only look for their files. CI runs them
(tests/test_gpu_calls.py), so a typo here never costs device minutes.

Only the standard library is imported: a broken torch or CUDA install fails a step, not the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PYTHON = "python3"  # the GPU machine has no `python`

ENV_REPORT = (
    "import sys, torch, triton, transformers; "
    "gpu = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None; "
    "print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, "
    "'| triton', triton.__version__, '| transformers', transformers.__version__, '|', "
    "f'{gpu.name}, {gpu.multi_processor_count} SMs, {gpu.total_memory / 2**30:.0f} GiB' if gpu else 'no GPU')"
)
CUTLASS_REPORT = "import cutlass; print('cutlass DSL', cutlass.__version__)"


@dataclass(frozen=True)
class Step:
    """One step of a call. `kind`: "shell" (a bash line), "pytest" (pytest arguments), "bench" (a
    benchmark script and its arguments; `dry_args` replace them in a dry run) or "kit" (a kit stage
    script). `needs`: steps that must have passed; `unless_hung`: steps that must not have timed out."""

    name: str
    kind: str
    args: tuple[str, ...]
    cap_s: int
    deadline_s: int = 0
    launch_blocking: bool = False
    needs: tuple[str, ...] = ()
    unless_hung: tuple[str, ...] = ()
    dry_args: tuple[str, ...] = ()


@dataclass
class Verdict:
    name: str
    verdict: str  # PASS, FAIL or TIMEOUT
    figure: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"VERDICT {self.name} {self.verdict} {self.figure}"


@dataclass(frozen=True)
class Call:
    budget_s: int  # no step starts (or runs) past this, counted from the call's start
    steps: tuple[Step, ...]


def _probe(name: str, test: str) -> Step:
    return Step(f"probe-{name}", "pytest", (test,), cap_s=60, deadline_s=45, launch_blocking=True)


def _decode_bench(name: str, kernels: str, cap_s: int) -> Step:
    """`bench_decode_gpu.py` at page 16 over `kernels` (its dry run: the same, tiny, on CPU)."""
    args = ("benchmarks/bench_decode_gpu.py", "--page-sizes", "16", "--kernels", kernels)
    return Step(name, "bench", args, cap_s=cap_s, dry_args=(args[0], "--dry-run", *args[1:]))


def _on_gpu(benchmark: str, dry: str = "") -> str:
    """A shell line running `benchmark` (a script and its arguments) where CUDA is visible, its tables
    in the log only (a call brings back at most 6 files); elsewhere (a dry run) `dry` instead, the
    same script at tiny sizes on CPU, or nothing."""
    cuda = f"{PYTHON} -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'"
    otherwise = f"BENCH_RESULTS_DIR=/tmp/bench {PYTHON} {dry}" if dry else "echo 'no CUDA GPU: not run'"
    return f"if {cuda}; then BENCH_RESULTS_DIR=/tmp/bench {PYTHON} {benchmark}; else {otherwise}; fi"


TRITON = "tests/gpu/test_triton_gpu.py"
CUTE = "tests/gpu/test_cute_gpu.py"
CALLS = {
    "call1": Call(
        budget_s=300,
        steps=(
            Step("kit-a", "kit", (".kit/a/stage.sh",), cap_s=30),
            Step("env", "shell", (f'nvidia-smi -L || true; {PYTHON} -c "{ENV_REPORT}"',), cap_s=40),
            _probe("reference-on-cuda", "tests/gpu/test_cuda_paths.py::test_reference_backend_on_cuda_matches_fp64"),
            _probe("store-gather-copy", f"{TRITON}::test_store_gather_copy_bit_exact[16-False]"),
            _probe("attention-split-decode", f"{TRITON}::test_flash_attention[decode-b1-32k-page16]"),
            _probe("fp8", f"{TRITON}::test_fp8_cache_store_gather_bit_exact_and_attention[dtype0-128]"),
            _probe(
                "mla",
                "tests/gpu/test_mla_gpu.py::test_mla_attention_matches_reference_and_fp64[decode-split-page64-h16-fp8-per-token]",
            ),
            _decode_bench("bench-decode", "triton,splits,sdpa,store", cap_s=75),
            Step(
                "bench-fp8",
                "shell",
                (
                    _on_gpu(
                        "benchmarks/bench_fp8.py --device cuda --batch 64 --context 4096",
                        dry="benchmarks/bench_fp8.py --device cpu --batch 2 --context 64 --accuracy-tokens 64",
                    ),
                ),
                cap_s=60,
            ),
            Step("generation", "pytest", ("tests/gpu/test_generation_gpu.py",), cap_s=60, deadline_s=50),
            Step("triton-tests", "pytest", (TRITON, "tests/gpu/test_decode_gpu.py"), cap_s=120, deadline_s=60),
        ),
    ),
    "call2": Call(
        budget_s=270,
        steps=(
            Step("kit-b", "kit", (".kit/b/stage.sh",), cap_s=100),
            Step("env", "shell", (f'{PYTHON} -c "{ENV_REPORT}"; {PYTHON} -c "{CUTLASS_REPORT}"',), cap_s=40),
            Step(
                "probe-cute-decode",
                "pytest",
                (f"{CUTE}::test_decode_matches_reference[dtype0-4-8192-16]",),
                cap_s=60,
                deadline_s=40,
                launch_blocking=True,
                needs=("kit-b",),
            ),
            Step(
                "cute-bf16-tests",
                "pytest",
                (CUTE, "--deselect", f"{CUTE}::test_decode_matches_reference[dtype1"),  # dtype1: float16
                cap_s=110,
                deadline_s=45,
                needs=("kit-b",),
                unless_hung=("probe-cute-decode",),
            ),
            Step(
                "cute-fp16-tests",
                "pytest",
                (
                    f"{CUTE}::test_decode_matches_reference",
                    "--deselect",
                    f"{CUTE}::test_decode_matches_reference[dtype0",  # dtype0: bfloat16, run above
                ),
                cap_s=60,
                deadline_s=45,
                needs=("kit-b",),
                unless_hung=("probe-cute-decode",),
            ),
            Step(
                "bench-cute",
                "bench",
                ("benchmarks/bench_cute_decode.py", "--page-sizes", "16,64,128"),
                cap_s=100,
                needs=("kit-b",),
                unless_hung=("probe-cute-decode",),
                dry_args=("benchmarks/bench_cute_decode.py", "--dry-run", "--page-sizes", "16"),
            ),
        ),
    ),
    "call3": Call(
        budget_s=300,
        steps=(
            Step("env", "shell", (f'{PYTHON} -c "{ENV_REPORT}"',), cap_s=40),
            Step("mla-tests", "pytest", ("tests/gpu/test_mla_gpu.py",), cap_s=90, deadline_s=45),  # (sparse: 7 more)
            Step("variants-tests", "pytest", ("tests/gpu/test_variants_gpu.py",), cap_s=60, deadline_s=40),
            Step(
                "cuda-paths-tests",
                "pytest",
                ("tests/gpu/test_cuda_paths.py", "tests/gpu/test_distributed_gpu.py"),  # (NCCL needs two GPUs)
                cap_s=40,
                deadline_s=30,
            ),
            Step("bench-mla-tiles", "shell", (_on_gpu("benchmarks/bench_mla_tiles_gpu.py"),), cap_s=100),  # (+6 sparse)
            Step(
                "bench-hf",
                "shell",
                (
                    _on_gpu(
                        "benchmarks/bench_hf.py --dtype bfloat16 --compile --repeats 3",
                        dry="benchmarks/bench_hf.py --repeats 1 --new-tokens 2 --layers 1 --hidden 64 --batch 2",
                    ),
                ),
                cap_s=100,
            ),
            _decode_bench("bench-window", "window,window-masked", cap_s=60),
        ),
    ),
}


# -- running one process ---------------------------------------------------------------------------


class Output:
    """Where everything printed goes: stdout (unbuffered) and the call's log."""

    def __init__(self, log: Path) -> None:
        self.log = log.open("w", encoding="utf-8")

    def __call__(self, line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        self.log.write(line + "\n")
        self.log.flush()


def run_process(command: list[str], env: dict[str, str], cap_s: float, out: Output) -> tuple[int | None, list[str]]:
    """Run `command` in its own process group, echoing its lines; kill the group after `cap_s`.
    Returns (exit status, or None when killed at the cap; the lines printed)."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    end = time.monotonic() + cap_s
    finished = False
    while not finished:
        try:
            line = lines.get(timeout=max(0.05, end - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            finished = True
        else:
            seen.append(line)
            out(line)
        if time.monotonic() > end:
            break
    if not finished:
        _kill(proc)
        while (line := _get_nowait(lines)) is not None:
            seen.append(line)
            out(line)
        return None, seen
    return proc.wait(), seen


def _kill(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _get_nowait(lines: queue.Queue) -> str | None:
    try:
        return lines.get(timeout=1)
    except queue.Empty:
        return None


# -- reading what a step printed -------------------------------------------------------------------

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_TEST_ID = re.compile(r"^(\S+\.py::\S+)")
_DEADLINE = re.compile(r"Timeout \(\d+:\d\d:\d\d\)!")  # faulthandler's, after the test's id on its line


def pytest_verdict(name: str, rc: int | None, lines: list[str], cap_s: float, deadline_s: float) -> Verdict:
    """The verdict of a pytest run from its exit status and its `-v -rfEs` output."""
    started = [m[1] for line in lines if (m := _TEST_ID.match(line))]
    last = started[-1] if started else "(none started)"
    if rc is None:
        return Verdict(name, "TIMEOUT", f"killed at the step cap of {cap_s:.0f}s; last test started: {last}")
    if any(_DEADLINE.search(line) for line in lines):
        return Verdict(name, "TIMEOUT", f"{last} ran past its {deadline_s:.0f}s deadline (tracebacks in the log)")
    counts: dict[str, int] = {}
    for line in lines:
        if line.startswith("=") and " in " in line:
            for number, what in _COUNT.findall(line):
                counts[what.rstrip("s") if what.startswith("error") else what] = int(number)
    passed, failed = counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0)
    skipped = counts.get("skipped", 0)
    if rc == 0 and passed:
        return Verdict(name, "PASS", f"{passed} passed" + (f", {skipped} skipped" if skipped else ""))
    if rc == 0:
        reason = next((line for line in lines if line.startswith("SKIPPED")), "")
        return Verdict(name, "FAIL", f"nothing passed ({skipped} skipped): {reason[:160]}")
    first = next((line.split(" ", 1)[1] for line in lines if line.startswith(("FAILED ", "ERROR "))), "")
    if failed:
        return Verdict(name, "FAIL", f"{failed} failed, {passed} passed; first: {first[:200]}")
    tail = next((line for line in reversed(lines) if line.strip()), "")
    return Verdict(name, "FAIL", f"pytest exit status {rc}: {tail[:200]}")


def row_verdict(step: str, row: dict, dry_run: bool) -> Verdict:
    """A benchmark row (`ROW {json}`) as a verdict: timed and checked is PASS; WRONG or unavailable FAIL."""
    page = f"@p{row['page_size']}" if row.get("page_size") is not None else ""
    name = f"{step}:{re.sub(r'[^A-Za-z0-9.]+', '-', str(row['kernel'])).strip('-')}{page}"
    us = row.get("us")
    if not isinstance(us, (int, float)):
        text = str(us)
        if dry_run and text.startswith("unavailable"):
            return Verdict(name, "PASS", f"dry run, {text[:160]}")
        return Verdict(name, "FAIL", text[:200])
    figure = f"{us:.1f} us"
    if row.get("GB/s") is not None:
        figure += f", {row['GB/s']:.0f} GB/s, {row['of_copy']:.2f} of copy"
    if row.get("target"):
        figure += f" (target {row['target']}: {'met' if row.get('meets') else 'MISSED'})"
    return Verdict(name, "PASS", figure)


# -- the call --------------------------------------------------------------------------------------


class Session:
    def __init__(self, call: str, dry_run: bool, out_dir: Path, budget_s: int | None = None) -> None:
        self.call, self.spec, self.dry_run = call, CALLS[call], dry_run
        if budget_s is not None:  # a call issued with less device time left than its own budget
            self.spec = replace(self.spec, budget_s=min(budget_s, self.spec.budget_s))
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out = Output(out_dir / f"{call}.log")
        self.start = time.monotonic()
        self.verdicts: list[Verdict] = []
        self.by_step: dict[str, Verdict] = {}
        self.collected: list[str] | None = None
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(HERE), os.environ.get("PYTHONPATH")) if p)
        self.env["BENCH_RESULTS_DIR"] = str(out_dir)  # the benchmarks' tables and JSON come back with the log
        if dry_run:
            self.env["TRITON_INTERPRET"] = "1"  # Triton on CPU tensors (tests/conftest.py sets it for pytest)

    def left_s(self) -> float:
        return self.spec.budget_s - (time.monotonic() - self.start)

    def record(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        self.out(verdict.line())

    def run(self) -> int:
        mode = " (dry run: no GPU steps)" if self.dry_run else ""
        self.out(f"== {self.call}{mode}: {len(self.spec.steps)} steps, budget {self.spec.budget_s}s")
        if self.dry_run:
            self.collected = self.collect()
        for step in self.spec.steps:
            verdict = self.blocked(step) or self.run_step(step)
            self.by_step[step.name] = verdict
            self.record(verdict)
        self.finish()
        return 0 if all(v.verdict == "PASS" for v in self.verdicts) else 1

    def blocked(self, step: Step) -> Verdict | None:
        """A verdict without running `step`: a step it needs failed, or the budget is spent."""
        if not self.dry_run:
            for need in step.needs:
                if need in self.by_step and self.by_step[need].verdict != "PASS":
                    return Verdict(step.name, "FAIL", f"not run: {need} did not pass")
            for need in step.unless_hung:
                if need in self.by_step and self.by_step[need].verdict == "TIMEOUT":
                    return Verdict(step.name, "FAIL", f"not run: {need} hung")
        if self.left_s() < 10:
            return Verdict(step.name, "TIMEOUT", f"not run: the call's {self.spec.budget_s}s budget is spent")
        return None

    def run_step(self, step: Step) -> Verdict:
        cap = min(step.cap_s, self.left_s())
        self.out(f"== {step.name} (cap {cap:.0f}s, {self.left_s():.0f}s left in the call)")
        started = time.monotonic()
        verdict = getattr(self, f"_{step.kind}")(step, cap)
        verdict.seconds = time.monotonic() - started
        return verdict

    # each kind of step

    def _shell(self, step: Step, cap: float) -> Verdict:
        rc, lines = run_process(["bash", "-c", step.args[0]], self.env, cap, self.out)
        last = next((line for line in reversed(lines) if line.strip()), "")
        if rc is None:
            return Verdict(step.name, "TIMEOUT", f"killed at {cap:.0f}s")
        return Verdict(step.name, "PASS" if rc == 0 else "FAIL", last[:200] if rc == 0 else f"exit {rc}: {last[:180]}")

    def _kit(self, step: Step, cap: float) -> Verdict:
        script = ROOT / step.args[0]
        if not script.is_file():
            how = f"carry {script.parent.relative_to(ROOT)} (built by ../shared/gpu/make-kit.sh)"
            if self.dry_run:
                return Verdict(step.name, "PASS", f"dry run: {script.relative_to(ROOT)} is not here; on the GPU, {how}")
            return Verdict(step.name, "FAIL", f"{script.relative_to(ROOT)} not on the machine: {how}")
        if self.dry_run:
            return Verdict(step.name, "PASS", f"dry run: {script.relative_to(ROOT)} found, not run")
        rc, lines = run_process(["bash", str(script)], self.env, cap, self.out)
        if rc is None:
            return Verdict(step.name, "TIMEOUT", f"killed at {cap:.0f}s")
        last = next((line for line in reversed(lines) if line.strip()), "")
        if rc == 0 and Path("/tmp/kit/env.sh").is_file():
            self.env["PYTHONPATH"] = self._kit_path()
        return Verdict(step.name, "PASS" if rc == 0 else "FAIL", last[:200])

    def _kit_path(self) -> str:
        """PYTHONPATH after `. /tmp/kit/env.sh` (the installed CuTe DSL) on top of this session's."""
        shown = subprocess.run(
            ["bash", "-c", '. /tmp/kit/env.sh && printf %s "$PYTHONPATH"'],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return shown.stdout or self.env["PYTHONPATH"]

    def _pytest(self, step: Step, cap: float) -> Verdict:
        if self.dry_run:
            return self._dry_pytest(step)
        env = dict(self.env)
        if step.launch_blocking:
            env["CUDA_LAUNCH_BLOCKING"] = "1"
        command = [PYTHON, "-m", "pytest", "-v", "-rfEs", "--tb=short", "-p", "deadline_plugin"]
        command += ["--deadline", str(step.deadline_s), *step.args]
        rc, lines = run_process(command, env, cap, self.out)
        return pytest_verdict(step.name, rc, lines, cap, step.deadline_s)

    def _bench(self, step: Step, cap: float) -> Verdict:
        args = step.dry_args if self.dry_run else step.args
        rc, lines = run_process([PYTHON, *args], self.env, cap, self.out)
        for line in lines:
            if line.startswith("COPY "):
                self.record(Verdict(f"{step.name}:copy", "PASS", f"{float(line.split()[1]):.0f} GB/s read + write"))
            elif line.startswith("ROW "):
                self.record(row_verdict(step.name, json.loads(line[4:]), self.dry_run))
        if rc is None:
            return Verdict(step.name, "TIMEOUT", f"killed at {cap:.0f}s (the rows above were measured)")
        if rc != 0 or not any(line.startswith("|---") for line in lines):
            last = next((line for line in reversed(lines) if line.strip()), "")
            return Verdict(step.name, "FAIL", f"exit {rc}: {last[:180]}")
        rows = sum(line.startswith("ROW ") for line in lines)
        return Verdict(step.name, "PASS", f"{rows} rows measured" + (" (dry run, CPU)" if self.dry_run else ""))

    # dry run: one collection for every pytest step of the call

    def collect(self) -> list[str]:
        """Every test id under the files the call's pytest steps name, collected once (on CPU)."""
        files = sorted({arg.split("::")[0] for s in self.spec.steps if s.kind == "pytest" for arg in _targets(s)})
        if not files:
            return []
        command = [PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "deadline_plugin", "--deadline", "1", *files]
        done = subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300)
        ids = [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
        self.out(f"dry run: collected {len(ids)} tests from {len(files)} files (pytest exit {done.returncode})")
        if done.returncode != 0:
            self.out(done.stdout[-3000:] + done.stderr[-3000:])
        return ids

    def _dry_pytest(self, step: Step) -> Verdict:
        assert self.collected is not None
        selected: set[str] = set()
        for target in _targets(step):
            found = [i for i in self.collected if i == target or i.startswith((target + "::", target + "["))]
            if not found:
                return Verdict(step.name, "FAIL", f"dry run: {target} matches no collected test")
            selected.update(found)
        deselect = tuple(step.args[i + 1] for i, a in enumerate(step.args) if a == "--deselect")
        kept = [i for i in selected if not i.startswith(deselect)] if deselect else list(selected)
        if not kept:
            return Verdict(step.name, "FAIL", "dry run: every test is deselected")
        return Verdict(step.name, "PASS", f"dry run: {len(kept)} tests collected")

    # the end

    def finish(self) -> None:
        table = ["| step | verdict | s | figure |", "|---|---|---|---|"]
        for v in self.verdicts:
            table.append(f"| {v.name} | {v.verdict} | {v.seconds:.0f} | {v.figure.replace('|', '/')} |")
        passed = sum(v.verdict == "PASS" for v in self.verdicts)
        took = time.monotonic() - self.start
        head = f"{self.call}{' (dry run)' if self.dry_run else ''}: {passed} of {len(self.verdicts)} PASS, {took:.0f}s"
        (self.out_dir / f"{self.call}.md").write_text(head + "\n\n" + "\n".join(table) + "\n")
        self.out("")
        self.out(f"== summary, {head}")
        for line in table:
            self.out(line)


def _targets(step: Step) -> list[str]:
    """The test files and ids a pytest step names (not option values)."""
    skip = {i + 1 for i, a in enumerate(step.args) if a == "--deselect"}
    return [a for i, a in enumerate(step.args) if i not in skip and not a.startswith("-")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("call", choices=sorted(CALLS))
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: collect the tests, run the benchmarks tiny on CPU"
    )
    parser.add_argument(
        "--budget",
        type=int,
        metavar="SECONDS",
        help="end the call sooner than its own budget (the device time left less about 60 s), so its "
        "summary and files come back before the device tool's limit kills it",
    )
    args = parser.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu")
    return Session(args.call, args.dry_run, out_dir, args.budget).run()


if __name__ == "__main__":
    sys.exit(main())
