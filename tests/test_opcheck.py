"""torch.library.opcheck on every op: schema, fake, dispatch and aliasing agree."""

import inspect
import re
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

import torch_paged_kv  # noqa: F401  (registers the ops)
from torch_paged_kv.ops import api, library, reference, reference_mla
from torch_paged_kv.ops.records import RECORDS
from torch_paged_kv.testing import make_paged_batch


@pytest.fixture(params=["default", "unchecked"])
def overload(request) -> str:
    return request.param


@pytest.fixture
def batch():
    return make_paged_batch([3, 0, 6], [2, 4, 1], page_size=4, group=2, seed=0)


def test_opcheck_store_kv(batch, overload):
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.store_kv, overload),
        (batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx),
    )


def test_opcheck_flash_attention(batch, overload):
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.flash_attention, overload),
        (batch.q, batch.blocks, *batch.step, batch.layer_idx, 0.5),
        {"causal": True, "sliding_window": 3, "softcap": 1.0},
    )


def test_opcheck_flash_attention_with_sinks_and_chunks(batch, overload):
    sinks = torch.randn(batch.q.shape[1])
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.flash_attention, overload),
        (batch.q, batch.blocks, *batch.step, batch.layer_idx, 0.5),
        {"sinks": sinks, "attention_chunk_size": 3},
    )


def test_opcheck_flash_attention_with_a_tree(batch, overload):
    tree = torch.tensor([1, 3, 1, 3, 5, 9, 1], dtype=torch.int64)  # per sequence: drafts 0 1 | 0 1 2 3 | 0
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.flash_attention, overload),
        (batch.q, batch.blocks, *batch.step, batch.layer_idx, 0.5),
        {"tree_mask": tree},
    )


def test_opcheck_gather_kv(batch, overload):
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.gather_kv, overload), (batch.blocks, *batch.step, batch.layer_idx, 8)
    )


def test_opcheck_copy_pages(batch, overload):
    src = torch.tensor([1, 2], dtype=torch.int32)
    dst = torch.tensor([4, 1], dtype=torch.int32)
    torch.library.opcheck(getattr(torch.ops.paged_kv.copy_pages, overload), (batch.blocks, src, dst))


CONTRACT = {  # docs/design.md's op contract; the registered schemas are derived from ops/api.py
    "store_kv": "(Tensor key, Tensor value, Tensor(a!) blocks, Tensor cache_lengths, Tensor lookup_table, "
    "Tensor input_row_offsets, int layer_idx, Tensor(a!)? scales=None) -> ()",
    "flash_attention": "(Tensor q, Tensor blocks, Tensor cache_lengths, Tensor lookup_table, Tensor input_row_offsets, "
    "int layer_idx, float softmax_scale, bool causal=True, int sliding_window=-1, float softcap=0., "
    "Tensor? scales=None, Tensor? sinks=None, int attention_chunk_size=-1, Tensor? tree_mask=None) -> Tensor",
    "gather_kv": "(Tensor blocks, Tensor cache_lengths, Tensor lookup_table, Tensor input_row_offsets, "
    "int layer_idx, int max_kv_len, Tensor? scales=None, ScalarType? out_dtype=None) -> (Tensor, Tensor)",
    "copy_pages": "(Tensor(a!) blocks, Tensor src_pages, Tensor dst_pages, Tensor(a!)? scales=None) -> ()",
    "store_latent": "(Tensor latent, Tensor k_rope, Tensor(a!) blocks, Tensor cache_lengths, Tensor lookup_table, "
    "Tensor input_row_offsets, int layer_idx, Tensor(a!)? scales=None) -> ()",
    "mla_attention": "(Tensor q_nope, Tensor q_rope, Tensor blocks, Tensor cache_lengths, Tensor lookup_table, "
    "Tensor input_row_offsets, int layer_idx, float softmax_scale, bool causal=True, Tensor? scales=None, "
    "Tensor? key_positions=None, Tensor? sinks=None) -> Tensor",
}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_schemas_are_the_contract(name, overload):
    """Positions, names, types, defaults and mutations of every overload are those of the contract
    (alias set names aside), so deriving schemas from the typed functions changed nothing."""
    schema = str(getattr(getattr(torch.ops.paged_kv, name), overload)._schema)
    assert re.sub(r"\(a\d+!\)", "(a!)", schema.split(name, 1)[1].removeprefix(".unchecked")) == CONTRACT[name]


def test_attention_output_is_contiguous_in_fake_and_real(batch):
    """A strided `q` (heads-major storage) gives a contiguous output in the fake as in every backend,
    so inductor's stride checks hold."""
    q = batch.q.transpose(0, 1).contiguous().transpose(0, 1)
    torch.library.opcheck(
        torch.ops.paged_kv.flash_attention.default, (q, batch.blocks, *batch.step, batch.layer_idx, 0.5)
    )
    out = torch.ops.paged_kv.flash_attention(q, batch.blocks, *batch.step, batch.layer_idx, 0.5)
    assert out.is_contiguous()


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_op_record_and_reference_take_the_public_signature(name):
    """The record every backend reads lists api.py's parameters (library.py checks it at import), and
    the reference, the tests' oracle, keeps the public signature itself."""
    library.check_record(name, RECORDS[name])
    oracle = getattr(reference_mla if "latent" in name or "mla" in name else reference, name)
    public = inspect.signature(api.OPS[name]).parameters.values()
    assert [(p.name, p.default) for p in inspect.signature(oracle).parameters.values()] == [
        (p.name, p.default) for p in public
    ]


class _Swapped(NamedTuple):  # copy_pages' record with two tensors in each other's place
    blocks: Tensor
    dst_pages: Tensor
    src_pages: Tensor
    scales: Tensor | None = None


class _OtherDefault(NamedTuple):
    blocks: Tensor
    src_pages: Tensor
    dst_pages: Tensor
    scales: Tensor | None = 0


class _OtherAnnotation(NamedTuple):
    blocks: Tensor
    src_pages: Tensor
    dst_pages: Tensor
    scales: int | None = None


class _Short(NamedTuple):
    blocks: Tensor
    src_pages: Tensor
    dst_pages: Tensor


@pytest.mark.parametrize("record", [_Swapped, _OtherDefault, _OtherAnnotation, _Short])
def test_a_record_that_drifts_from_the_public_signature_is_refused(record):
    with pytest.raises(TypeError, match="must list api.copy_pages's parameters"):
        library.check_record("copy_pages", record)
