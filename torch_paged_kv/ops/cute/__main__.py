"""`python -m torch_paged_kv.ops.cute --compile-only --arch sm_90a --keep-ptx DIR`: compile without a GPU.

Compiles every kernel variant of `variants.all_keys(arch)` (or a representative few with `--quick`)
for `arch`, writes each one's PTX to `DIR/<variant>.ptx`, and prints compile time, TMA instruction
counts and nested `elect.sync`s per variant; with ptxas and nvdisasm (on PATH, or the copies triton
bundles) also registers / spills from `ptxas -v` and the SASS's divergent warp syncs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import variants

COUNTED = {"tma": "cp.async.bulk.tensor", "gather4": "tile::gather4", "mbar_wait": "mbarrier.try_wait"}
DIVERGENT_SYNCS = ("BRA.DIV", "WARPSYNC.COLLECTIVE")
"""SASS of a warp-collective reached by a warp ptxas cannot prove converged: a branch on divergence
and the collective's slow path. In a decode kernel they mean a TMA copy issued from a divergent warp."""


def quick_keys(arch: str) -> list[variants.KernelKey]:
    """One variant per head_dim and dtype, the smallest and a large page size, plus the combine kernels."""
    pages = variants.PAGE_SIZES[arch]
    keys = [variants.combine_key(arch, "bfloat16", d) for d in variants.HEAD_DIMS]
    keys += [
        variants.decode_key(arch, "bfloat16", 128, pages[0], 4),
        variants.decode_key(arch, "float16", 128, 128, 8),
        variants.decode_key(arch, "bfloat16", 64, 16, 1),
        variants.decode_key(arch, "float16", 256, 256, 2),
    ]
    return keys


def compile_with_ptx(key: variants.KernelKey, out_dir: Path) -> tuple[float, str]:
    """Compile `key`, keep its PTX as `out_dir/<slug>.ptx`; (seconds, ptx text)."""
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        variants.build(key, ptx_dir=scratch)
        seconds = time.perf_counter() - start
        (ptx,) = Path(scratch).glob("*.ptx")
        target = out_dir / f"{key.slug()}.ptx"
        shutil.move(str(ptx), target)
    return seconds, target.read_text()


def cuda_tool(name: str) -> str | None:
    """`name` (ptxas, nvdisasm) from PATH, else the copy triton bundles in `triton/backends/nvidia/bin`."""
    found = shutil.which(name)
    if found is not None:
        return found
    spec = importlib.util.find_spec("triton")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "backends" / "nvidia" / "bin" / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def ptxas_usage(ptx_path: Path, arch: str) -> str:
    """'<registers> regs, <spill bytes> spill' from `ptxas -v` when ptxas is found, else ''."""
    ptxas = cuda_tool("ptxas")
    if ptxas is None:
        return ""
    log = subprocess.run(
        [ptxas, f"-arch={arch}", "-v", str(ptx_path), "-o", "/dev/null"], capture_output=True, text=True
    ).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return f"{max(map(int, regs), default=0)} regs, {sum(map(int, spills))} B spill" if regs else "ptxas failed"


def sass(ptx_path: Path, arch: str) -> str:
    """`ptx_path` assembled for `arch` by ptxas and disassembled by nvdisasm; '' when either is missing."""
    ptxas, nvdisasm = cuda_tool("ptxas"), cuda_tool("nvdisasm")
    if ptxas is None or nvdisasm is None:
        return ""
    cubin = ptx_path.with_suffix(".cubin")
    subprocess.run([ptxas, f"-arch={arch}", str(ptx_path), "-o", str(cubin)], check=True, capture_output=True)
    return subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def divergent_syncs(sass_text: str) -> int:
    """How many `DIVERGENT_SYNCS` instructions the SASS holds."""
    return sum(len(re.findall(rf"\b{re.escape(op)}\b", sass_text)) for op in DIVERGENT_SYNCS)


_LABEL = re.compile(r"^(\$?\w+):")
_BRANCH = re.compile(r"^(@!?%?\w+\s+)?bra(?:\.uni)?\s+(\$?\w+)\s*;")
_ELECT = "elect.sync"


def nested_elections(ptx: str) -> int:
    """`elect.sync`s that can run inside another one's elected region: the single lane the first
    election let through would run the second, a full-warp collective, alone (undefined in PTX; on
    sm_100a ptxas wraps it in divergent warp syncs). `cute.copy` of a TMA atom elects its lane itself,
    so a copy inside `with elect_one()` is one. The region starts after the branch that sends the
    other lanes to where they rejoin (the DSL's `elect_one` lowering) and is followed through the
    control-flow graph, line by line, up to that label."""
    lines = [line.split("//")[0].strip() for line in ptx.splitlines()]
    labels: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        if match := _LABEL.match(line):
            labels.setdefault(match[1], []).append(i)

    def target(name: str, at: int) -> int:  # inline-asm labels (LAB_WAIT, DONE) repeat: take the nearest
        return min(labels[name], key=lambda place: abs(place - at))

    def successors(i: int) -> list[int]:
        line = lines[i]
        if branch := _BRANCH.match(line):
            return [target(branch[2], i)] + ([i + 1] if branch[1] else [])
        return [] if line.startswith(("ret;", "exit;", "trap;")) or i + 1 == len(lines) else [i + 1]

    nested = 0
    for start, line in enumerate(lines):
        if _ELECT not in line:
            continue
        guard = next(i for i in range(start + 1, len(lines)) if _BRANCH.match(lines[i]) or _LABEL.match(lines[i]))
        branch = _BRANCH.match(lines[guard])
        if branch is None or not branch[1]:
            continue  # not the conditional skip of an elected region
        join, seen, todo = target(branch[2], guard), set(), [guard + 1]
        while todo:
            i = todo.pop()
            if i == join or i in seen:
                continue
            seen.add(i)
            if _ELECT in lines[i]:
                nested += 1
                break
            todo.extend(successors(i))
    return nested


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_paged_kv.ops.cute", description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", required=True, help="compile, do not run")
    parser.add_argument("--arch", choices=variants.ARCHES, required=True)
    parser.add_argument("--keep-ptx", metavar="DIR", default=None, help="write each variant's PTX here")
    parser.add_argument("--quick", action="store_true", help="a representative subset instead of every variant")
    args = parser.parse_args(argv)

    out_dir = Path(args.keep_ptx) if args.keep_ptx else Path(tempfile.mkdtemp(prefix="paged_kv_ptx_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = quick_keys(args.arch) if args.quick else variants.all_keys(args.arch)
    columns = [*COUNTED, "nested elect", "div. syncs", "ptxas"]
    print(f"| variant | compile s | {' | '.join(columns)} |\n|---|---|{'---|' * len(columns)}")
    total, problems = 0.0, 0
    for key in keys:
        seconds, ptx = compile_with_ptx(key, out_dir)
        total += seconds
        path = out_dir / f"{key.slug()}.ptx"
        nested, sass_text = nested_elections(ptx), sass(path, args.arch)
        divergent = str(divergent_syncs(sass_text)) if sass_text else "-"
        problems += nested > 0 or divergent not in ("0", "-")
        counts = " | ".join(str(ptx.count(needle)) for needle in COUNTED.values())
        print(f"| {key.slug()} | {seconds:.2f} | {counts} | {nested} | {divergent} | {ptxas_usage(path, args.arch)} |")
    print(f"\n{len(keys)} variants for {args.arch} in {total:.1f} s; PTX in {out_dir}")
    if problems:
        print(f"{problems} variants issue a TMA copy from a nested election or a divergent warp")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
