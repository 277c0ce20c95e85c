"""The `paged_kv` op library: every schema, fake and implementation registration, in one place.

Each implementation validates (shapes, then values) and hands the call to the backend that
`dispatch.select` picks. Registered with `Library.define/impl` (cheaper per eager call than
`custom_op`) under `CompositeExplicitAutograd`, so any device reaches the dispatcher.

Every op has a second overload, `.unchecked`, the same but for the value checks (shape checks still
run): for a caller whose step tensors an earlier checked call of the same step has covered, such as
the layers after layer 0. Being its own op, it stays itself in a compiled graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import dispatch, validate

lib = torch.library.Library("paged_kv", "DEF")

SIGNATURES = {
    "store_kv": "(Tensor key, Tensor value, Tensor(a!) blocks, Tensor cache_lengths, Tensor lookup_table, "
    "Tensor input_row_offsets, int layer_idx) -> ()",
    "flash_attention": "(Tensor q, Tensor blocks, Tensor cache_lengths, Tensor lookup_table, "
    "Tensor input_row_offsets, int layer_idx, float softmax_scale, bool causal=True, "
    "int sliding_window=-1, float softcap=0.0) -> Tensor",
    "gather_kv": "(Tensor blocks, Tensor cache_lengths, Tensor lookup_table, Tensor input_row_offsets, "
    "int layer_idx, int max_kv_len) -> (Tensor, Tensor)",
    "copy_pages": "(Tensor(a!) blocks, Tensor src_pages, Tensor dst_pages) -> ()",
}
OVERLOADS = ("", ".unchecked")

for _name, _signature in SIGNATURES.items():
    for _overload in OVERLOADS:
        lib.define(_name + _overload + _signature)


def _register_fake(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the fake of both overloads of `name`."""

    def register(fake: Callable) -> Callable:
        for overload in OVERLOADS:
            torch.library.register_fake(f"paged_kv::{name}{overload}", fake, lib=lib)
        return fake

    return register


# -- fakes ------------------------------------------------------------------------------------


@_register_fake("store_kv")
def _store_kv_fake(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx):
    validate.check_store_kv_meta(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx)


@_register_fake("flash_attention")
def _flash_attention_fake(
    q,
    blocks,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    layer_idx,
    softmax_scale,
    causal=True,
    sliding_window=-1,
    softcap=0.0,
):
    validate.check_flash_attention_meta(
        q,
        blocks,
        cache_lengths,
        lookup_table,
        input_row_offsets,
        layer_idx,
        softmax_scale,
        causal,
        sliding_window,
        softcap,
    )
    return torch.empty_like(q)


@_register_fake("gather_kv")
def _gather_kv_fake(blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len):
    validate.check_gather_kv_meta(blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len)
    shape = (cache_lengths.shape[0], max_kv_len, blocks.shape[4], blocks.shape[5])
    return blocks.new_empty(shape), blocks.new_empty(shape)


@_register_fake("copy_pages")
def _copy_pages_fake(blocks, src_pages, dst_pages):
    validate.check_copy_pages_meta(blocks, src_pages, dst_pages)


# -- implementations ------------------------------------------------------------------------


def _store_kv(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, *, value_checks=True):
    args = (key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx)
    validate.check_store_kv_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_store_kv_data(key, blocks, cache_lengths, lookup_table, input_row_offsets)
    dispatch.select("store_kv", blocks.device, args)(*args)


def _flash_attention(
    q,
    blocks,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    layer_idx,
    softmax_scale,
    causal=True,
    sliding_window=-1,
    softcap=0.0,
    *,
    value_checks=True,
):
    args = (
        q,
        blocks,
        cache_lengths,
        lookup_table,
        input_row_offsets,
        layer_idx,
        softmax_scale,
        causal,
        sliding_window,
        softcap,
    )
    validate.check_flash_attention_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_read_data(blocks, cache_lengths, lookup_table, input_row_offsets, q.shape[0])
    return dispatch.select("flash_attention", blocks.device, args)(*args)


def _gather_kv(blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len, *, value_checks=True):
    args = (blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len)
    validate.check_gather_kv_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_read_data(blocks, cache_lengths, lookup_table, input_row_offsets, None, max_kv_len)
    return dispatch.select("gather_kv", blocks.device, args)(*args)


def _copy_pages(blocks, src_pages, dst_pages, *, value_checks=True):
    args = (blocks, src_pages, dst_pages)
    validate.check_copy_pages_meta(*args)
    if value_checks and validate.data_checks_enabled(blocks.device):
        validate.check_copy_pages_data(*args)
    dispatch.select("copy_pages", blocks.device, args)(*args)


for _name, _impl in (
    ("store_kv", _store_kv),
    ("flash_attention", _flash_attention),
    ("gather_kv", _gather_kv),
    ("copy_pages", _copy_pages),
):
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
    lib.impl(f"{_name}.unchecked", functools.partial(_impl, value_checks=False), "CompositeExplicitAutograd")
