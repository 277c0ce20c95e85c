"""Shared benchmark plumbing: timing, copy bandwidth, paged decode inputs checked against SDPA, reports.

Every benchmark prints a markdown table last and writes the same rows, with the environment, to
`benchmarks/results/<name>.json` and `.md` (git-ignored; `BENCH_RESULTS_DIR` names another folder).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

import torch_paged_kv as pk
from torch_paged_kv.testing import ATTENTION_TOLERANCE

RESULTS_DIR = pathlib.Path(os.environ.get("BENCH_RESULTS_DIR") or pathlib.Path(__file__).resolve().parent / "results")


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


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (Linux), else 32 MiB."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = pathlib.Path(path).read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=32 << 20)


def cache_evictor() -> Callable[[], None]:
    """A function that reads twice the last-level cache's size: afterwards the caches hold its
    clean lines, none of what ran before."""
    buffer = torch.ones(2 * last_level_cache_bytes() // 4, dtype=torch.float32)

    def evict() -> None:
        buffer.sum()

    return evict


def round_robin_ms(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2, in_cache: Collection[str] = ()
) -> dict[str, list[float]]:
    """Milliseconds of each call of each of `fns` (CPU), called in turn, one call each per round,
    `repeats` rounds after `warmup`, so that load from other work on the machine drifts over all of
    them alike; each call after the caches are evicted (`cache_evictor`: as a model's step finds one
    layer's pages, other layers' pages and weights read since), except those named in `in_cache`."""
    evict, samples = cache_evictor(), {name: [] for name in fns}
    for round_ in range(warmup + repeats):
        for name, fn in fns.items():
            if name not in in_cache:
                evict()
            start = time.perf_counter()
            fn()
            if round_ >= warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def median_us(fn: Callable[[], Any], device: torch.device | str, repeats: int = 20) -> float:
    """Median microseconds of `fn()`: `triton.testing.do_bench` on CUDA, `time_ms` (`repeats` runs) elsewhere."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
    return time_ms(fn, warmup=min(3, repeats), repeats=repeats) * 1e3


def copy_bandwidth_gbps(device: torch.device | str, nbytes: int | None = None, repeats: int = 20) -> float:
    """GB/s of a device-to-device copy of `nbytes` (default 1 GiB on CUDA, 64 MiB elsewhere), read + write."""
    if nbytes is None:
        nbytes = 2**30 if torch.device(device).type == "cuda" else 2**26
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_us(lambda: dst.copy_(src), device, repeats) / 1e3


def decode_bytes(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one decode step must move: K and V of every cached token once, q read and out written once."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize * (2 * batch * context * kv_heads * head_dim + 2 * batch * q_heads * head_dim)


@dataclass
class DecodeInputs:
    """One decode step (one new query per sequence) over a collection with shuffled pages, layer 0."""

    q: torch.Tensor  # [batch, q_heads, head_dim]
    collection: pk.PagedKVCacheCollection
    step: pk.StepTensors
    context: int
    scale: float

    @property
    def args(self) -> tuple:
        """`paged_kv::flash_attention` arguments."""
        return (self.q, self.collection.blocks, *self.step, 0, self.scale)

    @property
    def pages_per_seq(self) -> int:
        """Pages holding one sequence's `context` tokens."""
        return -(-self.context // self.collection.params.page_size)

    def paged_attention(self, backend: str, **options: Any) -> Callable[[], torch.Tensor]:
        """A call of `paged_kv::flash_attention` on these inputs (and keyword `options`) with `backend` forced."""

        def run() -> torch.Tensor:
            with forced_backend(backend):
                return pk.flash_attention(*self.args, **options)

        return run

    def page_table(self) -> torch.Tensor:
        """`[batch, pages_per_seq]` int32 page ids of each sequence, in order."""
        return self.step.lookup_table[:, : self.pages_per_seq]

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as `[batch, kv_heads, context, head_dim]`, gathered by plain indexing (no paged_kv op)."""
        pages = self.collection.blocks[self.page_table().long(), :, 0]  # [batch, pages, 2, page, kv, d]
        batch, _, _, _, kv_heads, head_dim = pages.shape
        kv = pages.transpose(1, 2).reshape(batch, 2, -1, kv_heads, head_dim)[:, :, : self.context]
        key, value = kv.transpose(2, 3).unbind(1)
        return key.contiguous(), value.contiguous()

    def sdpa_reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key, value, SDPA output): `contiguous_kv` and SDPA over it, the answer every kernel must give."""
        key, value = self.contiguous_kv()
        return key, value, sdpa_decode(self.q, key, value, self.scale)


def paged_decode_inputs(
    batch: int,
    context: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> DecodeInputs:
    """Random K/V of `context` tokens per sequence in shuffled pages, and one new query per sequence.

    The new token's K/V is already stored (`cache_lengths = context - 1`, one query row each), so
    attention reads `context` keys per sequence.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-context // page_size)
    params = pk.KVCacheParams(dtype, 1, kv_heads, head_dim, page_size)
    collection = pk.PagedKVCacheCollection(params, batch * pages_per_seq, batch, context, device)
    collection.blocks.normal_(generator=gen)
    pages = torch.randperm(batch * pages_per_seq, generator=gen, device=device) + 1
    step = collection.step_tensors(batch)
    step.lookup_table[:, :pages_per_seq] = pages.view(batch, pages_per_seq).int()
    step.cache_lengths.fill_(context - 1)
    step.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
    q = torch.randn(batch, q_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return DecodeInputs(q, collection, step, context, head_dim**-0.5)


def sdpa_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of `q [batch, q_heads, d]` over contiguous `key`/`value [batch, kv_heads, context, d]` (GQA)."""
    return F.scaled_dot_product_attention(q[:, :, None], key, value, scale=scale, enable_gqa=True)[:, :, 0]


class WrongOutputError(Exception):
    """A kernel's output does not match the reference: it is not timed."""


def check_close(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise `WrongOutputError` unless `out` matches a non-zero `expected`, within
    `ATTENTION_TOLERANCE` of `out`'s dtype (a correct bf16 kernel is within ~5e-4 of SDPA at these
    shapes; one page of 16 keys dropped or misread moves some element by ~1.5e-2)."""
    if not expected.abs().sum().item():
        raise WrongOutputError(f"{what}: the expected output is all zeros; the inputs hold no data")
    try:
        torch.testing.assert_close(out, expected.to(out.dtype), **ATTENTION_TOLERANCE[out.dtype])
    except AssertionError as exc:
        raise WrongOutputError(f"{what}: " + " ".join(str(exc).split())) from None


def matches(expected: torch.Tensor, what: str) -> Callable[[torch.Tensor], None]:
    """A `DecodeBench.row` check: `check_close(out, expected, what)`."""
    return lambda out: check_close(out, expected, what)


@contextlib.contextmanager
def forced_backend(name: str) -> Iterator[None]:
    """Run the paged_kv ops with `TORCH_PAGED_KV_BACKEND=name` inside the block."""
    previous = os.environ.get("TORCH_PAGED_KV_BACKEND")
    os.environ["TORCH_PAGED_KV_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_PAGED_KV_BACKEND"]
        else:
            os.environ["TORCH_PAGED_KV_BACKEND"] = previous


def stream(line: str, payload: Any) -> None:
    """Print one measurement as soon as it is taken (`COPY <GB/s>`, `ROW <json>`): a run killed
    before its table still leaves its figures (benchmarks/gpu/session.py reads them)."""
    print(line, json.dumps(payload) if not isinstance(payload, (int, float)) else payload, flush=True)


class DecodeBench:
    """Rows of one decode shape: each kernel is checked before it is timed; GB/s counts `decode_bytes`,
    `of_copy` divides that by the measured `copy_bandwidth_gbps`. With `streaming`, the copy
    bandwidth and every row are printed as they are measured (`stream`). `repeats`: timed runs
    off CUDA (a dry run on CPU takes 2)."""

    def __init__(
        self,
        batch: int,
        context: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        streaming: bool = False,
        repeats: int = 20,
    ) -> None:
        self.shape = dict(
            batch=batch, context=context, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype
        )
        self.device = torch.device(device)
        self.moved = decode_bytes(batch, context, q_heads, kv_heads, head_dim, dtype)
        self.streaming, self.repeats = streaming, repeats
        self.copy_gbps = copy_bandwidth_gbps(self.device, repeats=repeats)
        if streaming:
            stream("COPY", self.copy_gbps)

    def inputs(self, page_size: int, seed: int = 0) -> DecodeInputs:
        """`paged_decode_inputs` of this shape."""
        return paged_decode_inputs(**self.shape, page_size=page_size, device=self.device, seed=seed)

    def setup(self) -> dict[str, Any]:
        """The shape, bytes moved and copy bandwidth, for `report`."""
        return {
            **self.shape,
            "dtype": str(self.shape["dtype"]).removeprefix("torch."),
            "bytes_moved": self.moved,
            "copy GB/s (read+write)": self.copy_gbps,
        }

    def sdpa_row(
        self, x: DecodeInputs, key: torch.Tensor, value: torch.Tensor, expected: torch.Tensor
    ) -> dict[str, Any]:
        """SDPA on the contiguous K/V of `x` (`x.sdpa_reference()`): the no-paging bound."""
        return self.row(
            "SDPA contiguous", None, lambda: partial(sdpa_decode, x.q, key, value, x.scale), matches(expected, "sdpa")
        )

    def row(
        self,
        kernel: str,
        page_size: int | None,
        make: Callable[[], Callable[[], Any]],
        check: Callable[[Any], None],
        bandwidth: bool = True,
        target: tuple[str, Callable[[dict[str, Any]], bool]] | None = None,
        moved: int | None = None,
    ) -> dict[str, Any]:
        """Build the call with `make()`, time its first call (compilation included), `check` that
        call's output, then time it. A call that cannot be built or run is reported in `us`; a
        wrong one too ("WRONG: ..."), never timed. `target`: (what it is, whether a timed row meets it).
        `moved`: the bytes the call must move, where they are not the shape's (`decode_bytes`)."""

        def run() -> tuple[float, float]:
            fn = make()
            start = time.perf_counter()
            out = fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            check(out)
            return median_us(fn, self.device, self.repeats), first_s

        result = _attempt(run)
        us, first_s = result if isinstance(result, tuple) else (result, None)
        gbps = (moved or self.moved) / us / 1e3 if bandwidth and isinstance(us, float) else None
        row = {
            "kernel": kernel,
            "page_size": page_size,
            "us": us,
            "GB/s": gbps,
            "of_copy": gbps / self.copy_gbps if gbps is not None else None,
            "first_call_s": first_s,
        }
        if target is not None:
            row["target"] = target[0]
            row["meets"] = isinstance(us, float) and target[1](row)
        if self.streaming:
            stream("ROW", row)
        return row


def _attempt(fn: Callable[[], Any]) -> Any:
    """`fn()`, or a string saying why it failed: an anchor that cannot run here is reported, not fatal."""
    try:
        return fn()
    except WrongOutputError as exc:
        return f"WRONG: {str(exc)[:200]}"
    except Exception as exc:
        first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
        return f"unavailable: {type(exc).__name__}: {first_line}"


def gpu_main(
    name: str, measure: Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]], device: torch.device | str = "cuda"
) -> int:
    """Entry point of a GPU benchmark: on CUDA without a GPU say so and return 0; else
    `report(name, *measure())` (a dry run measures tiny shapes on CPU, Triton in its interpreter).

    The ops' host-side index checks (a sync per call) are off unless TORCH_PAGED_KV_VALIDATE is set:
    every timed output is checked against a reference instead.
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU visible; nothing to measure.")
        return 0
    os.environ.setdefault("TORCH_PAGED_KV_VALIDATE", "shapes")
    print(report(name, *measure()))
    return 0


def environment() -> dict[str, str]:
    """Device and versions, recorded with every result."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": str(torch.get_num_threads()),
    }


def report(name: str, rows: list[dict[str, Any]], setup: dict[str, Any] | None = None) -> str:
    """Write rows (and `setup`) to results/<name>.json and .md; return the markdown.

    Columns are every key of any row, in first-seen order; a missing value or None shows as "-".
    """
    env = environment()
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"env": env, "setup": setup or {}, "rows": rows}, indent=2))
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    header = f"{name} on {env['device']} (torch {env['torch']}, {env['threads']} threads)"
    if setup:
        header += "\n\n" + ", ".join(f"{k}: {_fmt(v)}" for k, v in setup.items())
    text = header + "\n\n" + "\n".join(lines)
    (RESULTS_DIR / f"{name}.md").write_text(text + "\n")
    return text


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)
