"""Validation every op runs before it writes. A rejected call raises `ValueError` naming the argument.

`check_*_meta` looks at shapes, dtypes and devices only: the fakes run it while tracing. The real
implementations add `check_*_data`, which reads the index tensors (page ids, lengths, offsets).
On CUDA that is a host sync, so data checks are skipped while a CUDA graph is being captured and
can be switched off with `TORCH_PAGED_KV_VALIDATE=shapes` (default `full`), or per call through
the ops' `.unchecked` overloads; kernels still clamp out-of-range pages so that an unchecked bad
call cannot write outside `blocks`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NoReturn

import numpy as np
import torch
from torch import Tensor

from ..layout import NULL_PAGE
from . import dispatch
from .records import (
    CopyPagesArgs,
    FlashAttentionArgs,
    GatherKVArgs,
    MLAAttentionArgs,
    StoreKVArgs,
    StoreLatentArgs,
)

INDEX_DTYPE = torch.int32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def data_checks_enabled(device: torch.device) -> bool:
    """Whether the value checks run for tensors on `device` right now."""
    if os.environ.get("TORCH_PAGED_KV_VALIDATE", "full") == "shapes":
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _fail(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name}: {message}")


def _require(cond: bool | torch.SymBool, name: str, message: Callable[[], str]) -> None:
    """`ValueError(name: message())` unless `cond`; a symbolic `cond` on an unbacked size (a batch
    dimension marked with `torch._dynamo.mark_unbacked`) becomes a runtime assert instead of a guard.
    A plain `True` (every eager call) returns at once: `torch._check_with` costs about 2.5 us."""
    if cond is True:
        return
    torch._check_with(ValueError, cond, lambda: f"{name}: {message()}")


def _check_index(name: str, t: Tensor, dims: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"expected a tensor, got {type(t).__name__}")
    if t.dtype != INDEX_DTYPE:
        _fail(name, f"expected dtype int32, got {t.dtype}")
    if t.dim() not in dims:
        _fail(name, f"expected {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(name, f"expected device {device} (that of blocks), got {t.device}")
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        _fail(name, f"expected unit stride in the last dim (kernels index it densely), got strides {t.stride()}")


def _check_inference(name: str, t: Tensor) -> None:
    if t.requires_grad and torch.is_grad_enabled():
        _fail(
            name,
            "requires grad, but the paged_kv ops have no backward (the cache is for inference): "
            "call them under torch.no_grad() or torch.inference_mode()",
        )


def _check_blocks(blocks: Tensor, layer_idx: int, planes: tuple[int, ...] = (2,)) -> None:
    if not isinstance(blocks, Tensor) or blocks.dim() != 6:
        _fail("blocks", "expected a 6-D tensor [num_pages, 2|1, num_layers, page_size, num_kv_heads, head_dim]")
    if blocks.dtype not in CACHE_DTYPES:
        _fail("blocks", f"expected dtype float32/float16/bfloat16/float8_e4m3fn/float8_e5m2, got {blocks.dtype}")
    if blocks.shape[1] not in planes:
        if planes == (2,) and blocks.shape[1] == 1:
            _fail(
                "blocks",
                "an MLA latent cache (dim 1 is 1: one latent row per token, no K/V planes) is read and "
                "written by store_latent / mla_attention, not by this K/V op",
            )
        if planes == (1,) and blocks.shape[1] == 2:
            _fail("blocks", "this MLA op needs an MLA latent cache (dim 1 is 1), got a K/V cache (dim 1 is 2)")
        _fail("blocks", f"dim 1 must be {' or '.join(map(str, planes))} for this op, got {blocks.shape[1]}")
    if not blocks.is_contiguous():
        _fail("blocks", "expected a contiguous tensor (kernels address it as rows)")
    _check_inference("blocks", blocks)
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < blocks.shape[2]:
        _fail("layer_idx", f"expected 0..{blocks.shape[2] - 1}, got {layer_idx!r}")


def _check_scales(blocks: Tensor, scales: Tensor | None, quantized_width: int | None = None) -> None:
    """An FP8 `blocks` needs its fp32 scales: per granule (the shape of `blocks` but for the last dim,
    a divisor of `quantized_width`: head_dim, an MLA row's kv_lora_rank) or the static `[planes]`
    pair; any other cache takes none. Without `quantized_width`, an MLA pool's granules are not checked
    (its rank is not in the shape of `blocks`)."""
    if blocks.dtype not in FP8_DTYPES:
        if scales is not None:
            _fail("scales", f"only an FP8 cache has scales, but blocks is {blocks.dtype}")
        return
    if not isinstance(scales, Tensor):
        _fail("scales", f"an FP8 cache ({blocks.dtype}) needs its scales tensor, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        _fail("scales", f"expected dtype float32, got {scales.dtype}")
    if scales.device != blocks.device:
        _fail("scales", f"expected device {blocks.device} (that of blocks), got {scales.device}")
    if not scales.is_contiguous():
        _fail("scales", "expected a contiguous tensor (kernels address it as rows)")
    _check_inference("scales", scales)
    per_tensor = (blocks.shape[1],)
    per_granule = scales.dim() == 6 and scales.shape[:5] == blocks.shape[:5] and scales.shape[5] > 0
    if quantized_width is None and blocks.shape[1] == 2:
        quantized_width = blocks.shape[5]
    if per_granule and quantized_width is not None:
        per_granule = quantized_width % scales.shape[5] == 0
    if not per_granule and tuple(scales.shape) != per_tensor:
        width = "head_dim" if blocks.shape[1] == 2 else "kv_lora_rank"
        _fail(
            "scales",
            f"expected [{', '.join(map(str, blocks.shape[:5]))}, {width} / granularity] (per granule) or "
            f"{list(per_tensor)} (per tensor), got {list(scales.shape)}",
        )


def _check_step(blocks: Tensor, cache_lengths: Tensor, lookup_table: Tensor, input_row_offsets: Tensor) -> None:
    device = blocks.device
    _check_index("cache_lengths", cache_lengths, (1,), device)
    _check_index("lookup_table", lookup_table, (1, 2), device)
    _check_index("input_row_offsets", input_row_offsets, (1,), device)
    batch = cache_lengths.shape[0]
    _require(
        lookup_table.shape[0] == batch,
        "lookup_table",
        lambda: f"expected {batch} rows (one per cache_lengths entry), got {lookup_table.shape[0]}",
    )
    _require(
        input_row_offsets.shape[0] == batch + 1,
        "input_row_offsets",
        lambda: f"expected batch + 1 = {batch + 1} entries, got {input_row_offsets.shape[0]}",
    )


def _check_rows(name: str, t: Tensor, blocks: Tensor, heads: int | None = None) -> None:
    """New rows `[total_new, heads, head_dim]` in `blocks`' dtype (an FP8 cache: fp32/fp16/bf16)."""
    if not isinstance(t, Tensor) or t.dim() != 3:
        _fail(name, "expected a 3-D tensor [total_new, heads, head_dim]")
    if blocks.dtype in FP8_DTYPES:
        if t.dtype not in FLOAT_DTYPES:
            _fail(name, f"expected float32/float16/bfloat16 for an FP8 cache ({blocks.dtype}), got {t.dtype}")
    elif t.dtype != blocks.dtype:
        _fail(name, f"expected dtype {blocks.dtype} (that of blocks), got {t.dtype}")
    if t.device != blocks.device:
        _fail(name, f"expected device {blocks.device} (that of blocks), got {t.device}")
    if t.shape[2] != blocks.shape[5]:
        _fail(name, f"expected head_dim {blocks.shape[5]}, got {t.shape[2]}")
    if heads is not None and t.shape[1] != heads:
        _fail(name, f"expected {heads} kv heads, got {t.shape[1]}")
    _check_inference(name, t)


def check_store_kv_meta(a: StoreKVArgs) -> None:
    _check_blocks(a.blocks, a.layer_idx)
    _check_scales(a.blocks, a.scales)
    _check_step(a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)
    check_store_kv_rows(a)


def check_store_kv_rows(a: StoreKVArgs) -> None:
    """The shape checks of `store_kv` that concern the new rows (`step.StepPlan` runs only these at a
    later layer of a step, whose pool and step tensors the first layer checked)."""
    key, value, blocks = a.key, a.value, a.blocks
    _check_rows("key", key, blocks, blocks.shape[4])
    _check_rows("value", value, blocks, blocks.shape[4])
    if value.dtype != key.dtype:
        _fail("value", f"expected dtype {key.dtype} like key, got {value.dtype}")
    _require(
        value.shape[0] == key.shape[0], "value", lambda: f"expected {key.shape[0]} rows like key, got {value.shape[0]}"
    )


def check_step_rows(name: str, t: Tensor, step_rows: int | torch.SymInt, layer_idx: int, first_layer: int) -> None:
    """A later layer's new rows (`t.shape[0]`) against the `step_rows` its step's first layer passed
    (which its checked call matched to `input_row_offsets`): a shape check, no value read."""
    rows = t.shape[0]
    if not torch.compiler.is_compiling():
        if rows != step_rows:
            _fail(
                name,
                f"layer {layer_idx} got {rows} rows, but this step has {step_rows} new rows (as layer "
                f"{first_layer} got): every layer of a step takes the same new tokens",
            )
        return
    # traced sizes: a message of constants only (what torch.compile accepts in a check)
    message = f"{name}: layer {layer_idx} got other new rows than layer {first_layer}; every layer takes the same"
    torch._check_with(ValueError, rows == step_rows, lambda: message)


def check_flash_attention_meta(a: FlashAttentionArgs) -> None:
    _check_blocks(a.blocks, a.layer_idx)
    _check_scales(a.blocks, a.scales)
    _check_step(a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)
    check_flash_attention_rows(a)


def check_flash_attention_rows(a: FlashAttentionArgs) -> None:
    """The shape checks of `flash_attention` that concern the queries, the sinks and the scalars (see
    `check_store_kv_rows`)."""
    q, blocks, softmax_scale, softcap, sinks = a.q, a.blocks, a.softmax_scale, a.softcap, a.sinks
    _check_rows("q", q, blocks)
    if q.shape[1] % blocks.shape[4] != 0:
        _fail("q", f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {blocks.shape[4]}")
    if not softmax_scale > 0 or softmax_scale == float("inf"):
        _fail("softmax_scale", f"expected a finite positive float, got {softmax_scale!r}")
    if not softcap >= 0 or softcap == float("inf"):
        _fail("softcap", f"expected a finite float >= 0 (0 disables it), got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.dtype != torch.float32:
            _fail(
                "sinks",
                f"expected a 1-D float32 tensor [num_q_heads] (one logit per query head), got {_describe(sinks)}",
            )
        if sinks.shape[0] != q.shape[1]:
            _fail("sinks", f"expected {q.shape[1]} entries (one per query head of q), got {sinks.shape[0]}")
        if sinks.device != blocks.device:
            _fail("sinks", f"expected device {blocks.device} (that of blocks), got {sinks.device}")
        if sinks.stride(0) != 1 and sinks.shape[0] > 1:
            _fail("sinks", f"expected unit stride (kernels index it densely), got stride {sinks.stride(0)}")
        _check_inference("sinks", sinks)
    chunk = a.attention_chunk_size
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        _fail("attention_chunk_size", f"expected an int (<= 0 disables it), got {chunk!r}")
    tree = a.tree_mask
    if tree is not None:
        if not isinstance(tree, Tensor) or tree.dim() != 1 or tree.dtype != torch.int64:
            _fail(
                "tree_mask",
                f"expected a 1-D int64 tensor [total_new] (one bit mask per query row), got {_describe(tree)}",
            )
        _require(
            tree.shape[0] == q.shape[0],
            "tree_mask",
            lambda: f"expected {q.shape[0]} entries like q, got {tree.shape[0]}",
        )
        if tree.device != blocks.device:
            _fail("tree_mask", f"expected device {blocks.device} (that of blocks), got {tree.device}")
        if tree.stride(0) != 1 and tree.shape[0] > 1:
            _fail("tree_mask", f"expected unit stride (kernels index it densely), got stride {tree.stride(0)}")


def _describe(t: object) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def _check_mla_rows(name: str, t: Tensor, blocks: Tensor, dims: int) -> None:
    """MLA rows (`[total_new, width]` for the store, `[total_new, heads, width]` for the queries) in
    `blocks`' dtype (an FP8 pool: fp32/fp16/bf16) on its device."""
    if not isinstance(t, Tensor) or t.dim() != dims:
        shape = "[total_new, width]" if dims == 2 else "[total_new, num_heads, width]"
        _fail(name, f"expected a {dims}-D tensor {shape}, got {_shape_of(t)}")
    if blocks.dtype in FP8_DTYPES:
        if t.dtype not in FLOAT_DTYPES:
            _fail(name, f"expected float32/float16/bfloat16 for an FP8 cache ({blocks.dtype}), got {t.dtype}")
    elif t.dtype != blocks.dtype:
        _fail(name, f"expected dtype {blocks.dtype} (that of blocks), got {t.dtype}")
    if t.device != blocks.device:
        _fail(name, f"expected device {blocks.device} (that of blocks), got {t.device}")
    _check_inference(name, t)


def _shape_of(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def _check_mla_split(latent_name: str, rope_name: str, rank: int, rope_dim: int, blocks: Tensor) -> None:
    """`kv_lora_rank` latent then `rope_dim` rope elements fill the one head's row of `blocks` (two
    bytes per rope element after FP8 latent bytes: the rope-aware row)."""
    if blocks.shape[4] != 1:
        _fail("blocks", f"an MLA latent cache has one head (dim 4 is 1), got {blocks.shape[4]}")
    fp8 = blocks.dtype in FP8_DTYPES
    row = rank + rope_dim * (2 if fp8 else 1)
    if fp8 and rope_dim and rank % 2:
        _fail(latent_name, f"kv_lora_rank must be even in an FP8 row (its bf16 rope starts 2-byte aligned), got {rank}")
    if rank <= 0 or row != blocks.shape[5]:
        layout = f"{rank} FP8 latent bytes + {rope_dim} bf16 rope elements = {row} bytes" if fp8 else (
            f"{rank} latent + {rope_dim} rope elements = {row}"
        )  # fmt: skip
        _fail(
            latent_name,
            f"kv_lora_rank (from {latent_name}) and rope_dim (from {rope_name}) must fill blocks' row of "
            f"{blocks.shape[5]} elements, got {layout}",
        )


def _check_mla_call(
    a: StoreLatentArgs | MLAAttentionArgs, latent: tuple[str, Tensor], rope: tuple[str, Tensor], dims: int
) -> None:
    """An MLA op's shape checks: its pool, its (name, rows) of latent-width and rope-width rows
    (`[total_new, width]` for the store, `[total_new, heads, width]` for the queries), which fill one
    row of the pool between them, its scales and its step."""
    (latent_name, x), (rope_name, r), blocks = latent, rope, a.blocks
    _check_blocks(blocks, a.layer_idx, planes=(1,))
    _check_mla_rows(latent_name, x, blocks, dims)
    _check_mla_rows(rope_name, r, blocks, dims)
    _check_mla_split(latent_name, rope_name, x.shape[-1], r.shape[-1], blocks)
    _check_scales(blocks, a.scales, x.shape[-1])
    _check_step(blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)
    if r.dtype != x.dtype:
        _fail(rope_name, f"expected dtype {x.dtype} like {latent_name}, got {r.dtype}")
    if dims == 3 and r.shape[1] != x.shape[1]:
        _fail(rope_name, f"expected {x.shape[1]} heads like {latent_name}, got {r.shape[1]}")
    _require(
        r.shape[0] == x.shape[0], rope_name, lambda: f"expected {x.shape[0]} rows like {latent_name}, got {r.shape[0]}"
    )


def check_store_latent_meta(a: StoreLatentArgs) -> None:
    _check_mla_call(a, ("latent", a.latent), ("k_rope", a.k_rope), 2)


def check_mla_attention_meta(a: MLAAttentionArgs) -> None:
    _check_mla_call(a, ("q_nope", a.q_nope), ("q_rope", a.q_rope), 3)
    if not a.softmax_scale > 0 or a.softmax_scale == float("inf"):
        _fail("softmax_scale", f"expected a finite positive float, got {a.softmax_scale!r}")


def gather_dtype(blocks: Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """What `gather_kv` returns: `out_dtype`, else `blocks`' dtype (float32 for an FP8 cache)."""
    if out_dtype is not None:
        return out_dtype
    return torch.float32 if blocks.dtype in FP8_DTYPES else blocks.dtype


def check_gather_kv_meta(a: GatherKVArgs) -> None:
    blocks, max_kv_len, out_dtype = a.blocks, a.max_kv_len, a.out_dtype
    _check_blocks(blocks, a.layer_idx)
    _check_scales(blocks, a.scales)
    _check_step(blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)
    _require(max_kv_len >= 0, "max_kv_len", lambda: f"expected >= 0, got {max_kv_len}")
    if out_dtype is not None and out_dtype not in (torch.float64, *FLOAT_DTYPES) and out_dtype != blocks.dtype:
        _fail("out_dtype", f"expected float64/float32/float16/bfloat16 (or blocks' dtype), got {out_dtype}")


def check_copy_pages_meta(a: CopyPagesArgs) -> None:
    blocks, src_pages, dst_pages = a.blocks, a.src_pages, a.dst_pages
    if not isinstance(blocks, Tensor) or blocks.dim() != 6 or not blocks.is_contiguous():
        _fail("blocks", "expected a contiguous 6-D tensor")
    _check_inference("blocks", blocks)
    _check_scales(blocks, a.scales)
    _check_index("src_pages", src_pages, (1,), blocks.device)
    _check_index("dst_pages", dst_pages, (1,), blocks.device)
    _require(
        src_pages.shape[0] == dst_pages.shape[0],
        "dst_pages",
        lambda: f"expected {src_pages.shape[0]} entries like src_pages, got {dst_pages.shape[0]}",
    )


# -- value checks (real tensors only) ---------------------------------------------------------
# Done in numpy on host arrays: a view of CPU tensors (no copy; an order of magnitude cheaper per
# operation than torch on tiny index tensors), one small device-to-host copy of each index tensor
# on other devices (the sync the module docstring mentions).


def _host(t: Tensor) -> np.ndarray:
    return (t if t.device.type == "cpu" else t.cpu()).numpy().astype(np.int64, copy=False)


def _check_lengths(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    total_rows: int | None,
    rows_name: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Checks offsets and lengths; returns (cache_lengths, kv_len) as int64 host arrays."""
    offsets, lengths = _host(input_row_offsets), _host(cache_lengths)
    new = np.diff(offsets)
    kv_len = lengths + new
    capacity = blocks.shape[3] * (lookup_table.shape[1] if lookup_table.dim() == 2 else 1)
    if offsets[0] != 0:
        _fail("input_row_offsets", f"must start at 0, got {offsets[0]}")
    if (new < 0).any():
        _fail("input_row_offsets", f"must be non-decreasing; entry {np.flatnonzero(new < 0)[0] + 1} goes down")
    if (lengths < 0).any():
        b = np.flatnonzero(lengths < 0)[0]
        _fail("cache_lengths", f"sequence {b} has negative length {lengths[b]}")
    if (kv_len > capacity).any():
        b = np.flatnonzero(kv_len > capacity)[0]
        _fail(
            "cache_lengths",
            f"sequence {b} would reach {kv_len[b]} tokens, past the {capacity} its lookup_table row can address",
        )
    if total_rows is not None and offsets[-1] != total_rows:
        _fail("input_row_offsets", f"last entry {offsets[-1]} must equal the {total_rows} rows of {rows_name}")
    return lengths, kv_len


def _check_pages(blocks: Tensor, lookup_table: Tensor, first_tok: np.ndarray, end_tok: np.ndarray) -> None:
    """Every page holding tokens [first_tok[b], end_tok[b]) of each sequence is a real page of
    `blocks`: inside it and not the null page (which pads tables and holds no sequence's tokens)."""
    live = end_tok > first_tok
    if not live.any():
        return
    page_size = blocks.shape[3]
    if lookup_table.dim() == 2:
        num_cols = int(-(-end_tok.max() // page_size))
        table = _host(lookup_table[:, :num_cols])
        cols = np.arange(num_cols)
        used = (cols >= (first_tok // page_size)[:, None]) & (cols * page_size < end_tok[:, None]) & live[:, None]
    else:
        table = _host(lookup_table)[:, None]
        used = live[:, None]
    bad = used & ((table <= NULL_PAGE) | (table >= blocks.shape[0]))
    if bad.any():
        b, col = np.argwhere(bad)[0]
        page = table[b, col]
        if page == NULL_PAGE:
            _fail(
                "lookup_table",
                f"sequence {b} has no page for its tokens at entry {col} (it holds the "
                f"null page {NULL_PAGE}): allocate pages before storing or reading them",
            )
        _fail(
            "lookup_table", f"sequence {b} uses page id {page} (entry {col}), outside blocks' {blocks.shape[0]} pages"
        )


def _fast_yes(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    total_rows: int | None,
    reads_all: int,
    max_kv_len: int | None = None,
) -> bool:
    """The fast value check a backend registered for `blocks`' device type (`dispatch.ValueCheck`; the
    CPU kernels' one pass takes about 1 us where numpy takes tens): a yes settles it; on a no, or where
    none is registered, the checks below run and say what is wrong. `reads_all`: 0 (False) for a store
    (the new tokens' pages), 1 (True) for a read of every cached token, `W + 1` for a read within a
    sliding window of W (native/cache_ops.h's step_ok)."""
    check = dispatch.value_check(blocks.device.type)
    return check is not None and check(
        blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, reads_all, max_kv_len
    )


def check_store_kv_data(
    key: Tensor, blocks: Tensor, cache_lengths: Tensor, lookup_table: Tensor, input_row_offsets: Tensor
) -> None:
    if _fast_yes(blocks, cache_lengths, lookup_table, input_row_offsets, key.shape[0], False):
        return
    lengths, kv_len = _check_lengths(blocks, cache_lengths, lookup_table, input_row_offsets, key.shape[0], "key")
    _check_pages(blocks, lookup_table, lengths, kv_len)


def check_read_data(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    total_rows: int | None,
    max_kv_len: int | None = None,
    sliding_window: int = -1,
) -> None:
    """Checks for the ops that read the cached tokens (flash_attention, gather_kv, mla_attention): every
    one below each sequence's kv_len, or with `sliding_window` W > 0 those its queries may see, from
    position `cache_length - W + 1` (the first query's oldest key) on. Pages before that may be the null
    page: a sliding-window layer group's manager gives them back once no later query can see them."""
    reads = sliding_window + 1 if sliding_window > 0 else 1
    if _fast_yes(blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, reads, max_kv_len):
        return
    lengths, kv_len = _check_lengths(blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, "q")
    if max_kv_len is not None and kv_len.size and kv_len.max() > max_kv_len:
        b = kv_len.argmax()
        _fail("max_kv_len", f"sequence {b} holds {kv_len[b]} tokens, more than max_kv_len={max_kv_len}")
    first = np.maximum(lengths - (sliding_window - 1), 0) if sliding_window > 0 else np.zeros_like(kv_len)
    _check_pages(blocks, lookup_table, first, kv_len)


TREE_TOKENS = 64
"""Most new tokens of one sequence in a step with a `tree_mask` (one int64 of bits per query)."""


def check_tree_data(input_row_offsets: Tensor) -> None:
    """A step with a `tree_mask`: no sequence has more new tokens than its bits can name."""
    new = np.diff(_host(input_row_offsets))
    if new.size and new.max() > TREE_TOKENS:
        b = int(new.argmax())
        _fail(
            "tree_mask", f"sequence {b} has {new[b]} new tokens; a tree step names at most {TREE_TOKENS} per sequence"
        )


def check_copy_pages_data(blocks: Tensor, src_pages: Tensor, dst_pages: Tensor) -> None:
    num_pages = blocks.shape[0]
    dst = _host(dst_pages)
    for name, pages in (("src_pages", _host(src_pages)), ("dst_pages", dst)):
        bad = (pages < 0) | (pages >= num_pages)
        if bad.any():
            _fail(name, f"page id {pages[np.flatnonzero(bad)[0]]} is outside blocks' {num_pages} pages")
    if (dst == NULL_PAGE).any():
        _fail("dst_pages", f"lists the null page {NULL_PAGE}, which pads every table and must stay as it is")
    if np.unique(dst).size != dst.size:
        _fail("dst_pages", "lists a page more than once; the result would be ambiguous")
