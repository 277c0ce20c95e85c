"""Shape checks every op runs before it writes (`check_*_meta`): shapes, dtypes and devices only,
so the fakes run them while tracing too. A rejected call raises `ValueError` naming the argument.
The value checks that read the index tensors are `validate.py`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
from torch import Tensor

from .quant import FP8_DTYPES
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
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
TREE_TOKENS = 64
"""Most new tokens of one sequence in a step with a `tree_mask` (one int64 of bits per query)."""


CHECK_WITH_TRACES = torch.__version__ >= "2.13"  # (a TorchVersion: compared as a version)
"""Whether dynamo traces `torch._check_with(ValueError, ...)`: from torch 2.13 (its handlers of the
`torch._check*` family, pytorch#181552); torch 2.11 (the GPU machine's) breaks the graph on it."""


def fail(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name}: {message}")


def check_traced(cond: bool | torch.SymBool, message: Callable[[], str]) -> None:
    """`ValueError(message())` unless `cond`, traceable. While compiling on a torch older than 2.13
    (`CHECK_WITH_TRACES`), `torch._check(cond)`: a `RuntimeError` without the message (that dynamo
    took no message closure either)."""
    if CHECK_WITH_TRACES or not torch.compiler.is_compiling():
        torch._check_with(ValueError, cond, message)
    else:
        torch._check(cond)


def _require(cond: bool | torch.SymBool, name: str, message: Callable[[], str]) -> None:
    """`ValueError(name: message())` unless `cond`; a symbolic `cond` on an unbacked size (a batch
    dimension marked with `torch._dynamo.mark_unbacked`) becomes a runtime assert instead of a guard.
    A plain `True` (every eager call) returns at once: `torch._check_with` costs about 2.5 us."""
    if cond is True:
        return
    check_traced(cond, lambda: f"{name}: {message()}")


def _check_index(name: str, t: Tensor, dims: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a tensor, got {type(t).__name__}")
    if t.dtype != INDEX_DTYPE:
        fail(name, f"expected dtype int32, got {t.dtype}")
    if t.dim() not in dims:
        fail(name, f"expected {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        fail(name, f"expected device {device} (that of blocks), got {t.device}")
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        fail(name, f"expected unit stride in the last dim (kernels index it densely), got strides {t.stride()}")


def _check_inference(name: str, t: Tensor) -> None:
    if t.requires_grad and torch.is_grad_enabled():
        fail(
            name,
            "requires grad, but the paged_kv ops have no backward (the cache is for inference): "
            "call them under torch.no_grad() or torch.inference_mode()",
        )


def _check_blocks(blocks: Tensor, layer_idx: int, planes: tuple[int, ...] = (2,)) -> None:
    if not isinstance(blocks, Tensor) or blocks.dim() != 6:
        fail("blocks", "expected a 6-D tensor [num_pages, 2|1, num_layers, page_size, num_kv_heads, head_dim]")
    if blocks.dtype not in CACHE_DTYPES:
        fail("blocks", f"expected dtype float32/float16/bfloat16/float8_e4m3fn/float8_e5m2, got {blocks.dtype}")
    if blocks.shape[1] not in planes:
        if planes == (2,) and blocks.shape[1] == 1:
            fail(
                "blocks",
                "an MLA latent cache (dim 1 is 1: one latent row per token, no K/V planes) is read and "
                "written by store_latent / mla_attention, not by this K/V op",
            )
        if planes == (1,) and blocks.shape[1] == 2:
            fail("blocks", "this MLA op needs an MLA latent cache (dim 1 is 1), got a K/V cache (dim 1 is 2)")
        fail("blocks", f"dim 1 must be {' or '.join(map(str, planes))} for this op, got {blocks.shape[1]}")
    if not blocks.is_contiguous():
        fail("blocks", "expected a contiguous tensor (kernels address it as rows)")
    _check_inference("blocks", blocks)
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < blocks.shape[2]:
        fail("layer_idx", f"expected 0..{blocks.shape[2] - 1}, got {layer_idx!r}")


def _check_scales(blocks: Tensor, scales: Tensor | None, quantized_width: int | None = None) -> None:
    """An FP8 `blocks` needs its fp32 scales: per granule (the shape of `blocks` but for the last dim,
    a divisor of `quantized_width`: head_dim, an MLA row's kv_lora_rank) or the static `[planes]`
    pair; any other cache takes none. Without `quantized_width`, an MLA pool's granules are not checked
    (its rank is not in the shape of `blocks`)."""
    if blocks.dtype not in FP8_DTYPES:
        if scales is not None:
            fail("scales", f"only an FP8 cache has scales, but blocks is {blocks.dtype}")
        return
    if not isinstance(scales, Tensor):
        fail("scales", f"an FP8 cache ({blocks.dtype}) needs its scales tensor, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        fail("scales", f"expected dtype float32, got {scales.dtype}")
    if scales.device != blocks.device:
        fail("scales", f"expected device {blocks.device} (that of blocks), got {scales.device}")
    if not scales.is_contiguous():
        fail("scales", "expected a contiguous tensor (kernels address it as rows)")
    _check_inference("scales", scales)
    per_tensor = (blocks.shape[1],)
    per_granule = scales.dim() == 6 and scales.shape[:5] == blocks.shape[:5] and scales.shape[5] > 0
    if quantized_width is None and blocks.shape[1] == 2:
        quantized_width = blocks.shape[5]
    if per_granule and quantized_width is not None:
        per_granule = quantized_width % scales.shape[5] == 0
    if not per_granule and tuple(scales.shape) != per_tensor:
        width = "head_dim" if blocks.shape[1] == 2 else "kv_lora_rank"
        fail(
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


def _check_row_dtype_device(name: str, t: Tensor, blocks: Tensor) -> None:
    """New rows `t` in `blocks`' dtype (an FP8 cache takes fp32/fp16/bf16 rows) and on its device."""
    if blocks.dtype in FP8_DTYPES:
        if t.dtype not in FLOAT_DTYPES:
            fail(name, f"expected float32/float16/bfloat16 for an FP8 cache ({blocks.dtype}), got {t.dtype}")
    elif t.dtype != blocks.dtype:
        fail(name, f"expected dtype {blocks.dtype} (that of blocks), got {t.dtype}")
    if t.device != blocks.device:
        fail(name, f"expected device {blocks.device} (that of blocks), got {t.device}")


def _check_rows(name: str, t: Tensor, blocks: Tensor, heads: int | None = None) -> None:
    """New rows `[total_new, heads, head_dim]` in `blocks`' dtype (an FP8 cache: fp32/fp16/bf16)."""
    if not isinstance(t, Tensor) or t.dim() != 3:
        fail(name, "expected a 3-D tensor [total_new, heads, head_dim]")
    _check_row_dtype_device(name, t, blocks)
    if t.shape[2] != blocks.shape[5]:
        fail(name, f"expected head_dim {blocks.shape[5]}, got {t.shape[2]}")
    if heads is not None and t.shape[1] != heads:
        fail(name, f"expected {heads} kv heads, got {t.shape[1]}")
    _check_inference(name, t)


def _check_pool_and_step(a: StoreKVArgs | FlashAttentionArgs) -> None:
    """The pool (`blocks`, `scales`, the layer) and the step tensors of a K/V op's record."""
    _check_blocks(a.blocks, a.layer_idx)
    _check_scales(a.blocks, a.scales)
    _check_step(a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)


def check_store_kv_meta(a: StoreKVArgs) -> None:
    _check_pool_and_step(a)
    check_store_kv_rows(a)


def check_store_kv_rows(a: StoreKVArgs) -> None:
    """The shape checks of `store_kv` that concern the new rows (`step.StepPlan` runs only these at a
    later layer of a step, whose pool and step tensors the first layer checked)."""
    key, value, blocks = a.key, a.value, a.blocks
    _check_rows("key", key, blocks, blocks.shape[4])
    _check_rows("value", value, blocks, blocks.shape[4])
    if value.dtype != key.dtype:
        fail("value", f"expected dtype {key.dtype} like key, got {value.dtype}")
    _require(
        value.shape[0] == key.shape[0], "value", lambda: f"expected {key.shape[0]} rows like key, got {value.shape[0]}"
    )


def check_step_rows(name: str, t: Tensor, step_rows: int | torch.SymInt, layer_idx: int, first_layer: int) -> None:
    """A later layer's new rows (`t.shape[0]`) against the `step_rows` its step's first layer passed
    (which its checked call matched to `input_row_offsets`): a shape check, no value read."""
    rows = t.shape[0]
    if not torch.compiler.is_compiling():
        if rows != step_rows:
            fail(
                name,
                f"layer {layer_idx} got {rows} rows, but this step has {step_rows} new rows (as layer "
                f"{first_layer} got): every layer of a step takes the same new tokens",
            )
        return
    # traced sizes: a message of constants only (what torch.compile accepts in a check)
    message = f"{name}: layer {layer_idx} got other new rows than layer {first_layer}; every layer takes the same"
    check_traced(rows == step_rows, lambda: message)


def check_flash_attention_meta(a: FlashAttentionArgs) -> None:
    _check_pool_and_step(a)
    check_flash_attention_rows(a)


def check_flash_attention_rows(a: FlashAttentionArgs) -> None:
    """The shape checks of `flash_attention` that concern the queries, the sinks and the scalars (see
    `check_store_kv_rows`)."""
    q, blocks, softmax_scale, softcap, sinks = a.q, a.blocks, a.softmax_scale, a.softcap, a.sinks
    _check_rows("q", q, blocks)
    if q.shape[1] % blocks.shape[4] != 0:
        fail("q", f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {blocks.shape[4]}")
    if not softmax_scale > 0 or softmax_scale == float("inf"):
        fail("softmax_scale", f"expected a finite positive float, got {softmax_scale!r}")
    if not softcap >= 0 or softcap == float("inf"):
        fail("softcap", f"expected a finite float >= 0 (0 disables it), got {softcap!r}")
    if sinks is not None:
        _check_sinks(sinks, q, "q", blocks)
    chunk = a.attention_chunk_size
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        fail("attention_chunk_size", f"expected an int (<= 0 disables it), got {chunk!r}")
    tree = a.tree_mask
    if tree is not None:
        if not isinstance(tree, Tensor) or tree.dim() != 1 or tree.dtype != torch.int64:
            fail(
                "tree_mask",
                f"expected a 1-D int64 tensor [total_new] (one bit mask per query row), got {_describe(tree)}",
            )
        _require(
            tree.shape[0] == q.shape[0],
            "tree_mask",
            lambda: f"expected {q.shape[0]} entries like q, got {tree.shape[0]}",
        )
        if tree.device != blocks.device:
            fail("tree_mask", f"expected device {blocks.device} (that of blocks), got {tree.device}")
        if tree.stride(0) != 1 and tree.shape[0] > 1:
            fail("tree_mask", f"expected unit stride (kernels index it densely), got stride {tree.stride(0)}")


def _check_sinks(sinks: Tensor, q: Tensor, q_name: str, blocks: Tensor) -> None:
    """Attention sinks: fp32 `[heads]`, one logit per query head of `q`, on `blocks`' device."""
    if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.dtype != torch.float32:
        fail("sinks", f"expected a 1-D float32 tensor [num_q_heads] (one logit per query head), got {_describe(sinks)}")
    if sinks.shape[0] != q.shape[1]:
        fail("sinks", f"expected {q.shape[1]} entries (one per query head of {q_name}), got {sinks.shape[0]}")
    if sinks.device != blocks.device:
        fail("sinks", f"expected device {blocks.device} (that of blocks), got {sinks.device}")
    if sinks.stride(0) != 1 and sinks.shape[0] > 1:
        fail("sinks", f"expected unit stride (kernels index it densely), got stride {sinks.stride(0)}")
    _check_inference("sinks", sinks)


def _describe(t: object) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def _check_mla_rows(name: str, t: Tensor, blocks: Tensor, dims: int) -> None:
    """MLA rows (`[total_new, width]` for the store, `[total_new, heads, width]` for the queries) in
    `blocks`' dtype (an FP8 pool: fp32/fp16/bf16) on its device."""
    if not isinstance(t, Tensor) or t.dim() != dims:
        shape = "[total_new, width]" if dims == 2 else "[total_new, num_heads, width]"
        fail(name, f"expected a {dims}-D tensor {shape}, got {_shape_of(t)}")
    _check_row_dtype_device(name, t, blocks)
    _check_inference(name, t)


def _shape_of(t: object) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def _check_mla_split(latent_name: str, rope_name: str, rank: int, rope_dim: int, blocks: Tensor) -> None:
    """`kv_lora_rank` latent then `rope_dim` rope elements fill the one head's row of `blocks` (two
    bytes per rope element after FP8 latent bytes: the rope-aware row)."""
    if blocks.shape[4] != 1:
        fail("blocks", f"an MLA latent cache has one head (dim 4 is 1), got {blocks.shape[4]}")
    fp8 = blocks.dtype in FP8_DTYPES
    row = rank + rope_dim * (2 if fp8 else 1)
    if fp8 and rope_dim and rank % 2:
        fail(latent_name, f"kv_lora_rank must be even in an FP8 row (its bf16 rope starts 2-byte aligned), got {rank}")
    if rank <= 0 or row != blocks.shape[5]:
        layout = f"{rank} FP8 latent bytes + {rope_dim} bf16 rope elements = {row} bytes" if fp8 else (
            f"{rank} latent + {rope_dim} rope elements = {row}"
        )  # fmt: skip
        fail(
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
        fail(rope_name, f"expected dtype {x.dtype} like {latent_name}, got {r.dtype}")
    if dims == 3 and r.shape[1] != x.shape[1]:
        fail(rope_name, f"expected {x.shape[1]} heads like {latent_name}, got {r.shape[1]}")
    _require(
        r.shape[0] == x.shape[0], rope_name, lambda: f"expected {x.shape[0]} rows like {latent_name}, got {r.shape[0]}"
    )


def check_store_latent_meta(a: StoreLatentArgs) -> None:
    _check_mla_call(a, ("latent", a.latent), ("k_rope", a.k_rope), 2)


def check_mla_attention_meta(a: MLAAttentionArgs) -> None:
    _check_mla_call(a, ("q_nope", a.q_nope), ("q_rope", a.q_rope), 3)
    if not a.softmax_scale > 0 or a.softmax_scale == float("inf"):
        fail("softmax_scale", f"expected a finite positive float, got {a.softmax_scale!r}")
    positions = a.key_positions
    if positions is not None:
        _check_index("key_positions", positions, (2,), a.blocks.device)
        _require(
            positions.shape[0] == a.q_nope.shape[0],
            "key_positions",
            lambda: f"expected {a.q_nope.shape[0]} rows like q_nope (one per query), got {positions.shape[0]}",
        )
        _require(positions.shape[1] >= 1, "key_positions", lambda: "expected at least one column (k >= 1), got 0")
        if positions.stride(0) != positions.shape[1] and positions.shape[0] > 1:  # (static strides first)
            fail(
                "key_positions",
                f"expected contiguous rows (kernels index it densely), got strides {positions.stride()}",
            )
    if a.sinks is not None:
        _check_sinks(a.sinks, a.q_nope, "q_nope", a.blocks)


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
        fail("out_dtype", f"expected float64/float32/float16/bfloat16 (or blocks' dtype), got {out_dtype}")


def check_copy_pages_meta(a: CopyPagesArgs) -> None:
    blocks, src_pages, dst_pages = a.blocks, a.src_pages, a.dst_pages
    if not isinstance(blocks, Tensor) or blocks.dim() != 6 or not blocks.is_contiguous():
        fail("blocks", "expected a contiguous 6-D tensor")
    _check_inference("blocks", blocks)
    _check_scales(blocks, a.scales)
    _check_index("src_pages", src_pages, (1,), blocks.device)
    _check_index("dst_pages", dst_pages, (1,), blocks.device)
    _require(
        src_pages.shape[0] == dst_pages.shape[0],
        "dst_pages",
        lambda: f"expected {src_pages.shape[0]} entries like src_pages, got {dst_pages.shape[0]}",
    )
