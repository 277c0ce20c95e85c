"""The `paged_kv` op library: every schema, fake and implementation registration, in one place.

Schemas are derived from the typed public functions of `api.py` (the one signature source). Each
implementation validates (shapes, then values) and hands the call to the backend that
`dispatch.select` picks. Registered with `Library.define/impl` (cheaper per eager call than
`custom_op`) under `CompositeExplicitAutograd`, so any device reaches the dispatcher.

Every op has a second overload, `.unchecked`, the same but for the value checks (shape checks still
run): for a caller whose step tensors an earlier checked call of the same step has covered, such as
the layers after layer 0 (`step.StepPlan`). Being its own op, it stays itself in a compiled graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import api, dispatch, validate

lib = torch.library.Library("paged_kv", "DEF")
OVERLOADS = ("", ".unchecked")


def schema(name: str) -> str:
    """The schema of op `name`, from the signature of `api.<name>` (ints stay `int`, not `SymInt`:
    layer indices and lengths are per-call constants, never traced sizes)."""
    inferred = torch.library.infer_schema(api.OPS[name], mutates_args=api.MUTATED[name])
    return inferred.replace("SymInt", "int")


for _name in api.OPS:
    for _overload in OVERLOADS:
        lib.define(_name + _overload + schema(_name))


def _register_fake(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the fake of both overloads of `name`."""

    def register(fake: Callable) -> Callable:
        for overload in OVERLOADS:
            torch.library.register_fake(f"paged_kv::{name}{overload}", fake, lib=lib)
        return fake

    return register


# -- fakes ------------------------------------------------------------------------------------


@_register_fake("store_kv")
def _store_kv_fake(
    key: Tensor,
    value: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    scales: Tensor | None = None,
) -> None:
    validate.check_store_kv_meta(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, scales)


@_register_fake("flash_attention")
def _flash_attention_fake(
    q: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    softmax_scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    softcap: float = 0.0,
    scales: Tensor | None = None,
    sinks: Tensor | None = None,
    attention_chunk_size: int = -1,
) -> Tensor:
    validate.check_flash_attention_meta(
        q, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, softmax_scale, causal, sliding_window,
        softcap, scales, sinks, attention_chunk_size,
    )  # fmt: skip
    return q.new_empty(q.shape)  # contiguous, as every backend returns it (empty_like would keep q's strides)


@_register_fake("gather_kv")
def _gather_kv_fake(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    max_kv_len: int,
    scales: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    validate.check_gather_kv_meta(
        blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len, scales, out_dtype
    )
    shape = (cache_lengths.shape[0], max_kv_len, blocks.shape[4], blocks.shape[5])
    dtype = validate.gather_dtype(blocks, out_dtype)
    return blocks.new_empty(shape, dtype=dtype), blocks.new_empty(shape, dtype=dtype)


@_register_fake("copy_pages")
def _copy_pages_fake(blocks: Tensor, src_pages: Tensor, dst_pages: Tensor, scales: Tensor | None = None) -> None:
    validate.check_copy_pages_meta(blocks, src_pages, dst_pages, scales)


@_register_fake("store_latent")
def _store_latent_fake(
    latent: Tensor,
    k_rope: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    scales: Tensor | None = None,
) -> None:
    validate.check_store_latent_meta(
        latent, k_rope, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, scales
    )


@_register_fake("mla_attention")
def _mla_attention_fake(
    q_nope: Tensor,
    q_rope: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    softmax_scale: float,
    causal: bool = True,
    scales: Tensor | None = None,
) -> Tensor:
    validate.check_mla_attention_meta(
        q_nope, q_rope, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, softmax_scale, causal, scales
    )
    return q_nope.new_empty(q_nope.shape)  # contiguous whatever q_nope's strides (as every backend returns it)


# -- implementations: validate, then the selected backend's kernel ----------------------------
# Each takes the op's arguments in schema order, completed with the schema's defaults (a Python
# kernel receives only the arguments its caller passed), plus whether the value checks run.
# `checked_kernel` is that path up to the kernel, for `step.StepPlan`'s eager calls.


def _with_defaults(name: str) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A function completing op `name`'s positional arguments with its schema's trailing defaults."""
    arguments = getattr(torch.ops.paged_kv, name).default._schema.arguments
    defaults = [a.default_value for a in arguments if a.has_default_value()]
    total = len(arguments)

    def complete(args: tuple[Any, ...]) -> tuple[Any, ...]:
        missing = total - len(args)
        return args + tuple(defaults[len(defaults) - missing :]) if missing else args

    return complete


_complete = {name: _with_defaults(name) for name in api.OPS}


def _check_store_kv(args: tuple[Any, ...], value_checks: bool) -> torch.device:
    key, _, blocks, cache_lengths, lookup_table, input_row_offsets, _, _ = args
    validate.check_store_kv_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_store_kv_data(key, blocks, cache_lengths, lookup_table, input_row_offsets)
    return blocks.device


def _check_flash_attention(args: tuple[Any, ...], value_checks: bool) -> torch.device:
    q, blocks, cache_lengths, lookup_table, input_row_offsets = args[:5]
    validate.check_flash_attention_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_read_data(blocks, cache_lengths, lookup_table, input_row_offsets, q.shape[0])
    return blocks.device


def _check_gather_kv(args: tuple[Any, ...], value_checks: bool) -> torch.device:
    blocks, cache_lengths, lookup_table, input_row_offsets, _, max_kv_len, _, _ = args
    validate.check_gather_kv_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_read_data(blocks, cache_lengths, lookup_table, input_row_offsets, None, max_kv_len)
    return blocks.device


def _check_copy_pages(args: tuple[Any, ...], value_checks: bool) -> torch.device:
    validate.check_copy_pages_meta(*args)
    if value_checks and validate.data_checks_enabled(args[0].device):
        validate.check_copy_pages_data(*args[:3])
    return args[0].device


def _check_store_latent(args: tuple[Any, ...], value_checks: bool) -> torch.device:
    latent, _, blocks, cache_lengths, lookup_table, input_row_offsets, _, _ = args
    validate.check_store_latent_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_store_kv_data(latent, blocks, cache_lengths, lookup_table, input_row_offsets)
    return blocks.device


def _check_mla_attention(args: tuple[Any, ...], value_checks: bool) -> torch.device:
    q_nope, _, blocks, cache_lengths, lookup_table, input_row_offsets = args[:6]
    validate.check_mla_attention_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_read_data(blocks, cache_lengths, lookup_table, input_row_offsets, q_nope.shape[0])
    return blocks.device


_CHECKS: dict[str, Callable[[tuple[Any, ...], bool], torch.device]] = {
    # op name -> its checks (shapes; values too when asked): returns the device of its pool
    "store_kv": _check_store_kv,
    "flash_attention": _check_flash_attention,
    "gather_kv": _check_gather_kv,
    "copy_pages": _check_copy_pages,
    "store_latent": _check_store_latent,
    "mla_attention": _check_mla_attention,
}


def checked_kernel(
    name: str, args: tuple[Any, ...], value_checks: bool = True
) -> tuple[dispatch.Kernel, tuple[Any, ...]]:
    """What op `name`'s implementation does before it runs: complete `args` with the schema's
    defaults, validate them (shapes; values too with `value_checks`, unless turned off by
    `TORCH_PAGED_KV_VALIDATE`) and select the kernel. Returns (kernel, completed arguments)."""
    args = _complete[name](args)
    device = _CHECKS[name](args, value_checks)
    return dispatch.select(name, device, args), args


def _implementation(name: str) -> Callable[..., Any]:
    """The registered implementation of op `name`: check, then run the selected kernel."""

    def run(*args: Any, value_checks: bool = True) -> Any:
        kernel, args = checked_kernel(name, args, value_checks)
        return kernel(*args)

    return run


for _name in api.OPS:
    _impl = _implementation(_name)
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
    lib.impl(f"{_name}.unchecked", functools.partial(_impl, value_checks=False), "CompositeExplicitAutograd")
