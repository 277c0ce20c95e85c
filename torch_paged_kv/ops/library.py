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
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import api, dispatch, shape_checks, validate
from .records import (
    RECORDS,
    CopyPagesArgs,
    FlashAttentionArgs,
    GatherKVArgs,
    MLAAttentionArgs,
    StoreKVArgs,
    StoreLatentArgs,
)

lib = torch.library.Library("paged_kv", "DEF")
OVERLOADS = ("", ".unchecked")


def schema(name: str) -> str:
    """The schema of op `name`, from the signature of `api.<name>` (ints stay `int`, not `SymInt`:
    layer indices and lengths are per-call constants, never traced sizes)."""
    inferred = torch.library.infer_schema(api.OPS[name], mutates_args=api.MUTATED[name])
    return inferred.replace("SymInt", "int")


def check_record(name: str, record: type[tuple]) -> None:
    """Raise `TypeError` unless `record` has exactly the parameters of `api.<name>`: names in order,
    annotations and defaults (the record is what every backend reads; api.py is the signature)."""

    def parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        return [
            (p.name, getattr(p.annotation, "__forward_arg__", p.annotation), p.default)  # (a record's ForwardRefs)
            for p in inspect.signature(fn).parameters.values()
        ]

    want, got = parameters(api.OPS[name]), parameters(record)
    if got != want:
        raise TypeError(
            f"records.{record.__name__} must list api.{name}'s parameters (name, annotation, default) in "
            f"order: {want}, got {got}"
        )


for _name in api.OPS:
    check_record(_name, RECORDS[_name])
    for _overload in OVERLOADS:
        lib.define(_name + _overload + schema(_name))


def _register_fake(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function, which takes op `name`'s record, as the fake of both overloads."""
    record = RECORDS[name]

    def register(fake: Callable) -> Callable:
        def from_arguments(*args: Any, **kwargs: Any) -> Any:
            return fake(record(*args, **kwargs))

        for overload in OVERLOADS:
            torch.library.register_fake(f"paged_kv::{name}{overload}", from_arguments, lib=lib)
        return fake

    return register


# -- fakes ------------------------------------------------------------------------------------


@_register_fake("store_kv")
def _store_kv_fake(a: StoreKVArgs) -> None:
    shape_checks.check_store_kv_meta(a)


@_register_fake("flash_attention")
def _flash_attention_fake(a: FlashAttentionArgs) -> Tensor:
    shape_checks.check_flash_attention_meta(a)
    return a.q.new_empty(a.q.shape)  # contiguous, as every backend returns it (empty_like would keep q's strides)


@_register_fake("gather_kv")
def _gather_kv_fake(a: GatherKVArgs) -> tuple[Tensor, Tensor]:
    shape_checks.check_gather_kv_meta(a)
    shape = (a.cache_lengths.shape[0], a.max_kv_len, a.blocks.shape[4], a.blocks.shape[5])
    dtype = shape_checks.gather_dtype(a.blocks, a.out_dtype)
    return a.blocks.new_empty(shape, dtype=dtype), a.blocks.new_empty(shape, dtype=dtype)


@_register_fake("copy_pages")
def _copy_pages_fake(a: CopyPagesArgs) -> None:
    shape_checks.check_copy_pages_meta(a)


@_register_fake("store_latent")
def _store_latent_fake(a: StoreLatentArgs) -> None:
    shape_checks.check_store_latent_meta(a)


@_register_fake("mla_attention")
def _mla_attention_fake(a: MLAAttentionArgs) -> Tensor:
    shape_checks.check_mla_attention_meta(a)
    return a.q_nope.new_empty(a.q_nope.shape)  # contiguous whatever q_nope's strides (as every backend returns it)


# -- implementations: validate, then the selected backend's kernel ----------------------------
# Each builds the op's record from the arguments the dispatcher passes (a Python kernel receives
# only the arguments its caller passed; the record fills the schema's defaults), checks it (values
# too, unless `.unchecked`) and runs the selected backend's kernel on it. `checked_kernel` is that
# path up to the kernel, for `step.StepPlan`'s eager calls.


def _check_store_kv(a: StoreKVArgs, value_checks: bool) -> torch.device:
    shape_checks.check_store_kv_meta(a)
    if value_checks and validate.data_checks_enabled(a.blocks.device):
        validate.check_store_kv_data(a.key, a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)
    return a.blocks.device


def _check_flash_attention(a: FlashAttentionArgs, value_checks: bool) -> torch.device:
    shape_checks.check_flash_attention_meta(a)
    if value_checks and validate.data_checks_enabled(a.blocks.device):
        validate.check_read_data(
            a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets, a.q.shape[0], None, a.sliding_window
        )
        if a.tree_mask is not None:
            validate.check_tree_data(a.input_row_offsets, a.tree_mask)
    return a.blocks.device


def _check_gather_kv(a: GatherKVArgs, value_checks: bool) -> torch.device:
    shape_checks.check_gather_kv_meta(a)
    if value_checks and validate.data_checks_enabled(a.blocks.device):
        validate.check_read_data(a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets, None, a.max_kv_len)
    return a.blocks.device


def _check_copy_pages(a: CopyPagesArgs, value_checks: bool) -> torch.device:
    shape_checks.check_copy_pages_meta(a)
    if value_checks and validate.data_checks_enabled(a.blocks.device):
        validate.check_copy_pages_data(a.blocks, a.src_pages, a.dst_pages)
    return a.blocks.device


def _check_store_latent(a: StoreLatentArgs, value_checks: bool) -> torch.device:
    shape_checks.check_store_latent_meta(a)
    if value_checks and validate.data_checks_enabled(a.blocks.device):
        validate.check_store_kv_data(a.latent, a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets)
    return a.blocks.device


def _check_mla_attention(a: MLAAttentionArgs, value_checks: bool) -> torch.device:
    shape_checks.check_mla_attention_meta(a)
    if value_checks and validate.data_checks_enabled(a.blocks.device):
        validate.check_read_data(a.blocks, a.cache_lengths, a.lookup_table, a.input_row_offsets, a.q_nope.shape[0])
        if a.key_positions is not None:
            validate.check_key_positions_data(a.cache_lengths, a.input_row_offsets, a.key_positions, a.causal)
    return a.blocks.device


_CHECKS: dict[str, Callable[[Any, bool], torch.device]] = {
    # op name -> its checks (shapes; values too when asked): returns the device of its pool
    "store_kv": _check_store_kv,
    "flash_attention": _check_flash_attention,
    "gather_kv": _check_gather_kv,
    "copy_pages": _check_copy_pages,
    "store_latent": _check_store_latent,
    "mla_attention": _check_mla_attention,
}


def checked_kernel(name: str, a: tuple, value_checks: bool = True) -> dispatch.Kernel:
    """What op `name`'s implementation does before it runs, on its record `a`: validate it (shapes;
    values too with `value_checks`, unless turned off by `TORCH_PAGED_KV_VALIDATE`) and select the
    kernel, which takes `a`."""
    return dispatch.select(name, _CHECKS[name](a, value_checks), a)


def _implementation(name: str) -> Callable[..., Any]:
    """The registered implementation of op `name`: its record, checked, then the selected kernel."""
    record, checks = RECORDS[name], _CHECKS[name]

    def run(*args: Any, value_checks: bool = True) -> Any:
        a = record(*args)
        return dispatch.select(name, checks(a, value_checks), a)(a)  # (checked_kernel, inlined: per call)

    return run


for _name in api.OPS:
    _impl = _implementation(_name)
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
    lib.impl(f"{_name}.unchecked", functools.partial(_impl, value_checks=False), "CompositeExplicitAutograd")
