"""`python -m torch_paged_kv.ops.cute --compile-only --arch sm_90a --keep-ptx DIR`: compile without a GPU.

Compiles every kernel variant of `variants.all_keys(arch)` (or a representative few with `--quick`)
for `arch`, writes each one's PTX to `DIR/<variant>.ptx`, and prints compile time and TMA
instruction counts per variant (and registers / spills from `ptxas -v` when ptxas is on PATH).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import variants

COUNTED = {"tma": "cp.async.bulk.tensor", "gather4": "tile::gather4", "mbar_wait": "mbarrier.try_wait"}


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


def ptxas_usage(ptx_path: Path, arch: str) -> str:
    """'<registers> regs, <spill bytes> spill' from `ptxas -v` when ptxas is on PATH, else ''."""
    if shutil.which("ptxas") is None:
        return ""
    log = subprocess.run(
        ["ptxas", f"-arch={arch}", "-v", str(ptx_path), "-o", "/dev/null"], capture_output=True, text=True
    ).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return f"{max(map(int, regs), default=0)} regs, {sum(map(int, spills))} B spill" if regs else "ptxas failed"


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
    print(f"| variant | compile s | {' | '.join(COUNTED)} | ptxas |\n|---|---|{'---|' * len(COUNTED)}---|")
    total = 0.0
    for key in keys:
        seconds, ptx = compile_with_ptx(key, out_dir)
        total += seconds
        counts = " | ".join(str(ptx.count(needle)) for needle in COUNTED.values())
        usage = ptxas_usage(out_dir / f"{key.slug()}.ptx", args.arch)
        print(f"| {key.slug()} | {seconds:.2f} | {counts} | {usage} |", flush=True)
    print(f"\n{len(keys)} variants for {args.arch} in {total:.1f} s; PTX in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
