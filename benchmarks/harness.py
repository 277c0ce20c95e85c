"""Shared benchmark plumbing: median timing (CUDA events on GPU), markdown table, JSON results.

Every benchmark prints a markdown table last and writes the same rows, with the environment, to
`benchmarks/results/<name>.json` (git-ignored).
"""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import time
from typing import Any, Callable

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def time_ms(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 20) -> float:
    """Median wall time of `fn()` in milliseconds (CUDA-synchronised when CUDA is in use)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def environment() -> dict[str, str]:
    """Device and versions, recorded with every result."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "threads": str(torch.get_num_threads())}


def report(name: str, rows: list[dict[str, Any]]) -> str:
    """Write rows to results/<name>.json and return them as a markdown table."""
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"env": environment(), "rows": rows}, indent=2))
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]) for c in columns) + " |")
    env = environment()
    return f"{name} on {env['device']} (torch {env['torch']}, {env['threads']} threads)\n\n" + "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
